"""Where the trainer's background time goes, and what it adds to the loop, in one process.

A real instrumented loader runs in a loop while a thread writes its snapshots once a
second (SnapshotWriter.write, what the writer's thread runs). Each background activity is
timed per call, in the thread that runs it:

  snapshot write     the whole write: render and the file (a temporary, renamed)
  render             collect + encode to the text format
  collect            the trainer collector: flush (below) and the families built
  flush              drain the raw durations and bin them (numpy), then refresh the workers
  binning            the numpy part of flush, per histogram
  refresh            the workers: liveness and their /proc readings (at most once a 0.9 s)
  /proc readings     ProcAccount.observe: stat, io, status, schedstat, and PSS
  PSS                smaps_rollup (the kernel walks the worker's page tables), within its
                     budget (procstat.PSS_BUDGET of one core)
  tuner reading      a tuned loader's reading in the loop (a forced flush), and its iter()

For each: calls and CPU ms per second of training (the thread's CPU clock), the kernel's
share (system calls, run with the interpreter lock released: /proc, file I/O), and per
call the wall time (p50, max, which includes waiting for the lock after each system
call). Running Python, an activity holds the lock and the loop waits: "held ms/s" is the
snapshot write's CPU outside the kernel per second, what a loop running Python all the
time waits for. The loop's added time per batch against a bare torch DataLoader loop,
interleaved in short rounds (alternating order), varies by a few percent here from round
to round, so "held ms/s" is the finer figure for the realistic loop:

  cheap      TensorDataset, batch_size=1, num_workers=0, empty loop body: the worst case
  realistic  batch_size=32, num_workers=0, a ~5 ms step of pure Python (holds the GIL)
  workers    batch_size=32, 2 persistent workers, the same step (liveness, /proc readings)

"before" writes with prometheus_client's write_to_textfile (the directory made at each
write), "now" with the writer's own write() (the exporter's fast encoder), side by side.
Then each loop runs alone (the per-second tables), and a tuned loader (in-loop readings).

    python bench/background.py [--rounds 24] [--seconds 0.5] [--quick] [--workloads ...]
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from time import perf_counter_ns, thread_time_ns
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from prometheus_client import CollectorRegistry, write_to_textfile
from torch.utils.data import DataLoader, TensorDataset

from dataloader_exporter import instrument
from dataloader_exporter.instrument import (
    instruments,
    loader_collector,
    procstat,
    snapshot_writer,
    worker_tracker,
)
from dataloader_exporter.instrument.hotpath import recorder as hotpath_recorder
from dataloader_exporter.instrument.hub import hub_for
from dataloader_exporter.instrument.tuner import loop as tuner_loop

Step = Callable[[], None] | None
_LOOP = threading.main_thread()


class Calls:
    """Per-call wall times of one activity in one kind of thread, its CPU time (the
    thread's clock), and the kernel's share of it (getrusage: counted in ticks, so only
    its sum over many calls means anything)."""

    def __init__(self) -> None:
        self.wall_ns: list[int] = []
        self.cpu_ns = 0
        self.user_s = 0.0
        self.sys_s = 0.0

    def kernel_share(self) -> float:
        total = self.user_s + self.sys_s
        return self.sys_s / total if total else 0.0


CALLS: dict[tuple[str, str], Calls] = {}  # (variant, activity)
_on = threading.Event()  # activities are counted only during instrumented rounds
_variant = ["now"]  # the variant whose rounds run now


def _rusage() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime, r.ru_stime


def timed(owner: Any, attr: str, label: str) -> None:
    """Times every call of owner.attr under `label` (and " [loop]" in the loop's thread)."""
    original = getattr(owner, attr)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _on.is_set():
            return original(*args, **kwargs)
        (u0, s0), c0, w0 = _rusage(), thread_time_ns(), perf_counter_ns()
        try:
            result = original(*args, **kwargs)
            return iter(list(result)) if inspect.isgenerator(result) else result
        finally:
            wall, cpu, (u1, s1) = perf_counter_ns() - w0, thread_time_ns() - c0, _rusage()
            key = label + (" [loop]" if threading.current_thread() is _LOOP else "")
            c = CALLS.setdefault((_variant[0], key), Calls())
            c.wall_ns.append(wall)
            c.cpu_ns, c.user_s, c.sys_s = c.cpu_ns + cpu, c.user_s + u1 - u0, c.sys_s + s1 - s0

    setattr(owner, attr, wrapper)


def time_activities() -> None:
    timed(snapshot_writer.SnapshotWriter, "write", "snapshot write")
    timed(sys.modules[__name__], "write_before", "snapshot write")
    import prometheus_client.exposition as exposition
    timed(exposition, "generate_latest", "render (collect + encode)")
    timed(snapshot_writer, "text", "render (collect + encode)")
    timed(loader_collector.LoaderCollector, "collect", "collect")
    timed(hotpath_recorder.LoaderRecorder, "flush", "flush")
    timed(hotpath_recorder.DurationHistogram, "add_ns", "binning")
    timed(worker_tracker.WorkerTracker, "refresh", "refresh (liveness + /proc)")
    timed(procstat.ProcAccount, "observe", "/proc readings")
    timed(procstat.PssReader, "read", "PSS (within /proc readings)")
    timed(instruments.Instruments, "_read", "tuner reading")
    timed(tuner_loop.LoaderTuning, "at_iter", "tuner iter()")


class Ticker:
    """Calls `write` every `interval` s while an instrumented round runs, as the writer's
    thread does: ticks land in rounds in proportion to their length."""

    def __init__(self, interval: float = 1.0) -> None:
        self.write: Callable[[], Any] | None = None
        self._busy = threading.Lock()
        threading.Thread(target=self._run, args=(interval,), daemon=True).start()

    def during(self, variant: str, write: Callable[[], Any],
               run: Callable[[], tuple[int, int]]) -> tuple[int, int]:
        _variant[0] = variant  # "<workload> <before|now>"
        self.write = write
        _on.set()
        try:
            return run()
        finally:
            _on.clear()
            with self._busy:  # a write under way finishes before the next round
                self.write = None

    def _run(self, interval: float) -> None:
        while True:
            time.sleep(interval)
            with self._busy:
                if self.write is not None:
                    self.write()


def make_step(target_s: float) -> Step:
    """A step of pure Python work taking about target_s (calibrated here)."""
    def work(k: int) -> float:
        acc = 0.0
        for i in range(k):
            acc += i * 0.5
        return acc

    k = 20000
    t0 = time.perf_counter()
    work(k)
    k = max(1000, int(k * target_s / max(time.perf_counter() - t0, 1e-6)))

    def step() -> None:
        work(k)

    return step


def run_for(make_iter: Callable[[], Iterator[Any]], state: dict[str, Any], seconds: float,
            step: Step) -> tuple[int, int]:
    """Batches and ns of `seconds` of the loop; the iterator lives on across rounds."""
    n, t0 = 0, perf_counter_ns()
    end = t0 + int(seconds * 1e9)
    while perf_counter_ns() < end:
        try:
            next(state["it"])
        except (StopIteration, KeyError):
            state["it"] = make_iter()
            continue
        if step is not None:
            step()
        n += 1
    return n, perf_counter_ns() - t0


def workloads(step: Step, directory: str, names: list[str]
              ) -> dict[str, tuple[Any, Any, Step, Any]]:
    """name -> (bare loader, instrumented loader, step, its snapshot writer)."""
    out = {}
    specs = {"cheap": (1, 0, None), "realistic": (32, 0, step), "workers": (32, 2, step)}
    for name, (bs, nw, st) in specs.items():
        if name not in names:
            continue
        ds = TensorDataset(torch.randn(200_000, 16), torch.randint(0, 10, (200_000,)))
        extra = {"persistent_workers": True} if nw else {}
        registry = CollectorRegistry()
        inst = instrument.DataLoader(ds, batch_size=bs, num_workers=nw, name=name,
                                     registry=registry, **extra)
        writer = snapshot_writer.SnapshotWriter(hub_for(registry)._snapshot_registry(),
                                                directory, 1.0)
        out[name] = (DataLoader(ds, batch_size=bs, num_workers=nw, **extra), inst, st, writer)
    return out


def write_before(writer: snapshot_writer.SnapshotWriter) -> None:
    """The write as prometheus_client's write_to_textfile makes it, directory made first."""
    os.makedirs(writer.directory, exist_ok=True)
    write_to_textfile(writer.path, writer.registry)


def measure(rounds: int, seconds: float, step: Step, directory: str, names: list[str],
            steady: float) -> dict[str, dict[str, list[float]]]:
    """Per workload, per variant: per-round ns a batch; ratios paired within a round. Then
    each instrumented loop alone for `steady` s: the readings with a wall-clock budget
    (liveness, /proc, PSS) come at their own pace only when the loader runs all the time."""
    ticker = Ticker()
    loads = workloads(step, directory, names)
    states = {(w, v): {} for w in loads for v in ("bare", "before", "now")}
    out: dict[str, dict[str, list[float]]] = {w: {} for w in loads}
    for r in range(rounds):
        for w, (bare, inst, st, writer) in loads.items():
            variants = ["bare", "before", "now"]
            if r % 2:
                variants.reverse()
            per: dict[str, float] = {}
            for v in variants:
                loader = bare if v == "bare" else inst
                state = states[w, v] if v == "bare" else states[w, "now"]

                def run(loader: Any = loader, state: dict[str, Any] = state,
                        st: Step = st) -> tuple[int, int]:
                    return run_for(lambda: iter(loader), state, seconds, st)

                if v == "bare":
                    n, ns = run()
                else:
                    write = writer.write if v == "now" else functools.partial(
                        write_before, writer)
                    n, ns = ticker.during(f"{w} {v}", write, run)
                per[v] = ns / max(n, 1)
                out[w].setdefault("seconds " + v, []).append(ns / 1e9)
            for v in ("before", "now"):
                out[w].setdefault("added_us " + v, []).append((per[v] - per["bare"]) / 1e3)
                out[w].setdefault("ratio " + v, []).append(per[v] / per["bare"])
            out[w].setdefault("bare_us", []).append(per["bare"] / 1e3)
    for w, (_bare, inst, st, writer) in loads.items():  # each alone, at the pace it has
        n, ns = ticker.during(f"{w} alone", writer.write, functools.partial(
            run_for, lambda inst=inst: iter(inst), states[w, "now"], steady, st))
        out[w]["seconds alone"] = [ns / 1e9]
    return out


def tuned_run(directory: str, step: Step, epochs: int) -> float:
    """A tuned loader for a few short epochs; the seconds it ran (activities counted)."""
    ds = TensorDataset(torch.randn(4096, 16))
    loader = instrument.DataLoader(ds, batch_size=32, num_workers=1, name="tuned",
                                   registry=CollectorRegistry(), tune=True)
    _variant[0] = "tuned"
    _on.set()
    t0 = time.perf_counter()
    try:
        for _ in range(epochs):
            for _batch in loader:
                if step is not None:
                    step()
    finally:
        _on.clear()
    return time.perf_counter() - t0


def table(seconds: dict[str, float]) -> None:
    """One block per variant: its activities per second of its own rounds."""
    for variant, per_s in seconds.items():
        rows = [(label, c) for (v, label), c in CALLS.items() if v == variant and c.wall_ns]
        if not rows or not per_s:
            continue
        print(f"\n{variant}: per second of training ({per_s:.0f} s)")
        print(f"  {'activity':34} {'calls/s':>7} {'CPU ms/s':>9} {'kernel':>7} "
              f"{'wall/call p50':>14} {'max':>9}")
        for label, c in sorted(rows, key=lambda r: -r[1].cpu_ns):
            print(f"  {label:34} {len(c.wall_ns) / per_s:7.2f} {c.cpu_ns / 1e6 / per_s:9.3f} "
                  f"{c.kernel_share():7.0%} {statistics.median(c.wall_ns) / 1e3:11.0f} us "
                  f"{max(c.wall_ns) / 1e3:6.0f} us")


def held_ms(workload: str, variant: str, per_s: float) -> float:
    """The snapshot write's CPU ms outside the kernel per second of training."""
    c = CALLS.get((f"{workload} {variant}", "snapshot write"))
    return c.cpu_ns / 1e6 * (1 - c.kernel_share()) / per_s if c and per_s else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--seconds", type=float, default=0.5, help="per variant and round")
    parser.add_argument("--quick", action="store_true", help="4 rounds, no workers, no tuner")
    parser.add_argument("--workloads", default="cheap,realistic,workers")
    args = parser.parse_args(argv)
    names = args.workloads.split(",")
    if args.quick:
        args.rounds = 4
        names = [n for n in names if n != "workers"]
    torch.set_num_threads(1)
    time_activities()
    step = make_step(0.005)
    with tempfile.TemporaryDirectory() as directory:
        results = measure(args.rounds, args.seconds, step, directory, names,
                          steady=3.0 if args.quick else 8.0)
        tuned_s = 0.0 if args.quick or "workers" not in names else tuned_run(
            directory, step, epochs=4)
    seconds = {f"{w} {v}": sum(results[w]["seconds " + v]) for w in results
               for v in ("before", "now", "alone")} | {"tuned": tuned_s}
    print(f"{'workload':10} {'bare us/batch':>13} {'added us before':>16} {'now':>8} "
          f"{'ratio before':>13} {'now':>7} {'held ms/s before':>17} {'now':>6}"
          f"   (medians over {args.rounds} rounds)")
    for w, r in results.items():
        med = {k: statistics.median(v) for k, v in r.items()}
        held = [held_ms(w, v, seconds[f"{w} {v}"]) for v in ("before", "now")]
        print(f"{w:10} {med['bare_us']:13.1f} {med['added_us before']:16.2f} "
              f"{med['added_us now']:8.2f} {med['ratio before']:13.4f} {med['ratio now']:7.4f} "
              f"{held[0]:17.2f} {held[1]:6.2f}")
    print("\n(interleaved rounds: 'before' and 'now' above; the per-second tables below are "
          "of each loop alone, writing as now, and of the tuned loader)")
    table({k: v for k, v in seconds.items() if k.endswith(("alone", "tuned"))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
