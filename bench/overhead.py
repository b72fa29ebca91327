"""What instrument.DataLoader costs a training loop, next to a bare loop and torch.profiler.

One process, variants interleaved in short rounds with alternating order, so the machine's
noise (mostly slow drift) hits all alike. Figures are medians over rounds; added µs and
ratios are paired within a round. Iterators live across rounds, as in a long epoch.

  cheap      TensorDataset, batch_size=1, num_workers=0, empty loop body: the worst case.
  realistic  batch_size=32 and a ~5 ms step of pure Python work, which holds the GIL like
             a step launching GPU kernels (and varies less than small matmuls).

The instrumented loop also pays for the trainer's background work: a thread writes a snapshot
of the registry (SnapshotWriter.write: drain and bin the raw durations, render with the fast
encoder, write the file) about once per instrumented second, as the snapshot writer does;
its CPU time (GIL held) is spread over the batches and added. torch.profiler
(CPU, a record_function per step) is timed in its `with` block (in-loop, which the targets
use) and with its start, post-processing and the collection of its events' cycles.

A 5 ms step varies by about 1% from round to round here, more than the cost looked for, so
the realistic workload also gets an estimate from finer figures of the same run: the cheap
loop's added time a batch (the same per-batch code) plus the background's CPU a batch.

    python bench/overhead.py [--quick] [--strict] [--realistic-rounds N]
    (profiler USDT lines on stderr are harmless)
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import platform
import random
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter, perf_counter_ns
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from _background_writes import Background
from prometheus_client import CollectorRegistry
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.data import DataLoader, TensorDataset

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.core.envnames import ENV_DIR
from dataloader_exporter.instrument.rank import current_rank
from dataloader_exporter.instrument.torch_originals import TORCH_ITER

Step = Callable[[], None] | None
VARIANTS = ("bare", "instrumented", "profiler")
MAX_ADDED_US = 3.0  # cheap workload: µs added per batch
MAX_RATIO = 1.01  # realistic workload: under 1% of a ~5 ms step
MAX_CHEAP_RATIO = 1.05  # cheap workload: loop and background together
MAX_REALISTIC_ESTIMATE = 1.003  # realistic workload, estimated from the finer figures
MIN_CHEAPER = 20.0  # cheap workload: the profiler's added cost (in-loop) over ours


def loop(it: Iterator[Any], n: int, step: Step) -> tuple[int, int]:
    """The training loop under test: n batches from `it`; batches seen, ns taken."""
    i, t0 = 0, perf_counter_ns()
    for _batch in it:
        if step is not None:
            step()
        i += 1
        if i == n:
            break
    return i, perf_counter_ns() - t0


def profiled_loop(it: Iterator[Any], n: int, step: Step) -> tuple[int, int, int]:
    """The loop under torch.profiler: batches, ns in the loop, ns with start, exit, cleanup."""
    def traced() -> None:
        with record_function("train_step"):
            if step is not None:
                step()

    start = perf_counter_ns()
    with profile(activities=[ProfilerActivity.CPU]):
        i, in_loop = loop(it, n, traced)
    gc.collect()  # its events hold reference cycles: free them now, on its account
    return i, in_loop, perf_counter_ns() - start


def make_dataset(n: int, width: int = 16) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, width, generator=g)
    return TensorDataset(x, torch.randint(0, 10, (n,), generator=g))


def make_step(target_s: float) -> tuple[Step, float]:
    """k iterations of Python arithmetic, k calibrated to take about target_s; its time."""
    def work(k: int) -> float:
        t0, x = perf_counter(), 0
        for i in range(k):
            x += i
        return perf_counter() - t0

    k = max(1, round(target_s / statistics.median(work(100_000) / 100_000 for _ in range(5))))

    def step() -> None:
        work(k)

    return step, statistics.median(work(k) for _ in range(20))


@dataclass
class Workload:
    name: str
    batches: int  # per round and variant
    batch_size: int
    step: Step
    rounds: int
    profile_every: int  # the profiler's cost is large: it needs fewer rounds


def run_workload(w: Workload, background: Background, registry: CollectorRegistry
                 ) -> tuple[list[dict[str, float]], list[str]]:
    """µs per batch of each variant, one dict per round, and any problems found."""
    ds = make_dataset((2 * w.rounds + 2) * w.batches * w.batch_size)  # bare, profiler share
    bare = iter(DataLoader(ds, batch_size=w.batch_size))
    inst = iter(instrument.DataLoader(ds, batch_size=w.batch_size, name=w.name,
                                      registry=registry))
    runs: dict[str, Callable[[], tuple[int, ...]]] = {
        "bare": lambda: loop(bare, w.batches, w.step),
        "instrumented": lambda: background.during(lambda: loop(inst, w.batches, w.step)),
        "profiler": lambda: profiled_loop(bare, w.batches, w.step),
    }
    for run in runs.values():  # warm-up: first batches, profiler start-up
        run()
    inst_batches, rounds, problems = w.batches, [], []
    seen = {True: 0, False: 0}  # rounds with and without the profiler
    for r in range(w.rounds):
        # The profiler goes first; bare and instrumented alternate who goes first, in
        # rounds with the profiler and in rounds without it alike.
        prof = r % w.profile_every == 0
        pair = VARIANTS[:2] if seen[prof] % 2 == 0 else VARIANTS[1::-1]
        seen[prof] += 1
        result: dict[str, float] = {}
        for v in ("profiler", *pair) if prof else pair:
            n, ns, *session_ns = runs[v]()
            if n != w.batches:
                problems.append(f"{w.name}/{v} round {r}: {n} batches, expected {w.batches}")
            inst_batches += n if v == "instrumented" else 0
            result[v] = ns / 1e3 / max(n, 1)
            if session_ns:
                result["session"] = session_ns[0] / 1e3 / max(n, 1)
        rounds.append(result)
    labels = {"loader": w.name, "rank": current_rank()}
    if (counted := registry.get_sample_value(cat.BATCHES.name, labels)) != inst_batches:
        problems.append(f"{w.name}: registry counted {counted} batches, loop saw {inst_batches}")
    return rounds, problems


def epoch_start_us(reps: int) -> tuple[float, float]:
    """Median µs of iter() plus the first batch: bare, then instrumented (interleaved).
    Bare is torch's own __iter__, as in a process without instrumentation: the class hook
    that instrument.DataLoader installs on torch's DataLoader (a plain loader over an
    adopted loader's dataset passes through it) is taken off for the measurement."""
    ds, registry = make_dataset(64), CollectorRegistry()
    loaders = (DataLoader(ds), instrument.DataLoader(ds, name="epochs", registry=registry))
    times: tuple[list[float], list[float]] = ([], [])
    hooked = vars(DataLoader)["__iter__"]
    DataLoader.__iter__ = TORCH_ITER  # type: ignore[method-assign]
    try:
        for _ in range(reps + 1):  # the first is a warm-up (and logs the config once)
            for loader, out in zip(loaders, times, strict=True):
                t0 = perf_counter_ns()
                next(iter(loader))
                out.append((perf_counter_ns() - t0) / 1e3)
    finally:
        DataLoader.__iter__ = hooked  # type: ignore[method-assign]
    return statistics.median(times[0][1:]), statistics.median(times[1][1:])


def check_same_data(n: int = 1000, batch_size: int = 3) -> list[str]:
    """Bare and instrumented loaders, shuffled from the same seed, yield identical batches."""
    ds, registry = make_dataset(n), CollectorRegistry()
    bare = DataLoader(ds, batch_size, shuffle=True, generator=torch.Generator().manual_seed(7))
    inst = instrument.DataLoader(ds, batch_size, shuffle=True, name="verify", registry=registry,
                                 generator=torch.Generator().manual_seed(7))
    problems = []
    for epoch in range(2):
        a, b = list(bare), list(inst)
        if len(a) != len(b) or not all(
                len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y, strict=True))
                for x, y in zip(a, b, strict=True)):
            problems.append(f"epoch {epoch}: instrumented batches differ from the bare loader's")
    labels = {"loader": "verify", "rank": current_rank()}
    for metric, want in ((cat.BATCHES, 2 * len(bare)), (cat.SAMPLES, 2 * n)):
        if (got := registry.get_sample_value(metric.name, labels)) != want:
            problems.append(f"{metric.name} = {got}, expected {want}")
    return problems


def summarize(rounds: list[dict[str, float]], background_us: float) -> dict[str, float]:
    """Medians over rounds, added µs and ratios paired with the same round's bare loop. The
    snapshot writes' CPU time, spread over the instrumented batches, is added to ours: few
    rounds hold a write, so the median would leave it out. The spread: the 90% bootstrap
    interval of the median, and the quartiles of the rounds' ratios."""
    s: dict[str, float] = {}
    for v in (*VARIANTS, "session"):
        paired = [(r["bare"], r[v]) for r in rounds if v in r]
        s[f"{v}_us"] = statistics.median(x for _, x in paired)
        if v != "bare":
            s[f"{v}_added_us"] = statistics.median(x - b for b, x in paired)
            s[f"{v}_ratio"] = statistics.median(x / b for b, x in paired)
    lo, hi = bootstrap_interval([r["instrumented"] - r["bare"] for r in rounds])
    q1, _, q3 = statistics.quantiles([r["instrumented"] / r["bare"] for r in rounds], n=4)
    s["ratio_q1"], s["ratio_q3"] = q1 + background_us / s["bare_us"], q3 + background_us / s[
        "bare_us"]
    s["loop_added_us"], s["background_us"] = s["instrumented_added_us"], background_us
    s["instrumented_added_us"] += background_us
    s["instrumented_ratio"] += background_us / s["bare_us"]
    s["instrumented_added_lo"], s["instrumented_added_hi"] = lo + background_us, hi + background_us
    s["ratio_lo"], s["ratio_hi"] = 1 + s["instrumented_added_lo"] / s["bare_us"], 1 + s[
        "instrumented_added_hi"] / s["bare_us"]
    ours = s["instrumented_added_us"]
    for v in ("profiler", "session"):  # <= 0: ours is lost in noise
        s[f"cheaper_x_{v}"] = s[f"{v}_added_us"] / ours if ours > 0 else float("inf")
    return s


def bootstrap_interval(xs: list[float], reps: int = 2000) -> tuple[float, float]:
    """90% bootstrap interval of the median of xs (fixed seed: reruns print the same)."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(reps))
    return meds[reps // 20], meds[reps - reps // 20 - 1]


def report(w: Workload, s: dict[str, float], step_ms: float) -> None:
    what = "empty step" if w.step is None else f"{step_ms:.2f} ms step"
    print(f"\n{w.name} (batch_size={w.batch_size}, {what}; {w.rounds} rounds of {w.batches} "
          f"batches, profiler in 1 of {w.profile_every}): µs per batch, added, ratio to bare")
    print(f"  {'bare':<27}{s['bare_us']:10.2f}")
    for v, label in (("instrumented", "instrumented"), ("profiler", "torch.profiler, in-loop"),
                     ("session", "torch.profiler, with exit")):
        print(f"  {label:<27}{s[f'{v}_us']:10.2f} {s[f'{v}_added_us']:+9.2f}  "
              f"{s[f'{v}_ratio']:.4f}x")
    times = {v: f"{s[f'cheaper_x_{v}']:.1f}x" for v in ("profiler", "session")}
    print(f"  instrumented added = loop {s['loop_added_us']:+.2f} + snapshot writes "
          f"{s['background_us']:+.2f}; 90% interval {s['instrumented_added_lo']:+.2f} .. "
          f"{s['instrumented_added_hi']:+.2f} ({s['ratio_lo']:.4f}x .. {s['ratio_hi']:.4f}x); "
          f"rounds' ratios, quartiles {s['ratio_q1']:.4f}x .. {s['ratio_q3']:.4f}x"
          f"\n  ours is {times['profiler']} cheaper than the profiler in-loop, "
          f"{times['session']} with its exit (inf: ours is lost in noise)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~10x smaller, for a smoke run")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    ap.add_argument("--realistic-rounds", type=int, default=0, metavar="N",
                    help="rounds of the realistic workload (default 80, 8 with --quick)")
    args = ap.parse_args(argv)
    # no num_workers=0 advice
    logging.getLogger("dataloader_exporter.instrument").setLevel(logging.ERROR)
    os.environ.pop(ENV_DIR, None)  # no snapshot thread of our own: registries are local
    torch.set_num_threads(1)  # 2 OpenMP threads on 2 vCPUs stall when a third thread runs
    t0 = perf_counter()
    step, step_s = make_step(0.005)
    # Short rounds, many of them: pairing cancels slow drift (and a busy neighbour's bursts,
    # which last longer than a round of 1,000 cheap batches, about 20 ms).
    cheap_w = Workload("cheap", 500 if args.quick else 1000, 1, None, 6 if args.quick else 120,
                       3 if args.quick else 15)
    real_w = Workload("realistic", 25, 32, step,
                      args.realistic_rounds or (8 if args.quick else 80), 4)
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} "
          f"CPUs, 1 torch thread")
    registry = CollectorRegistry()
    background = Background(registry)
    # A full collection over torch's objects takes ~70 ms here and lands at random in one
    # variant or in the background thread; frozen, they are not scanned again (fair to all).
    gc.freeze()
    summaries, problems = [], []
    for w in (cheap_w, real_w):
        since = len(background.cpu_s)
        rounds, found = run_workload(w, background, registry)
        ours = background.cpu_s[since:]
        background_us = sum(ours) * 1e6 / (w.batches * (w.rounds + 1))
        summaries.append(summarize(rounds, background_us))
        summaries[-1]["write_ms"] = statistics.median(ours) * 1e3 if ours else math.nan
        problems += found
        report(w, summaries[-1], step_s * 1e3)
    cheap, real = summaries
    writes = background.cpu_s
    write_ms = statistics.median(writes) * 1e3 if writes else math.nan
    # The realistic loop from finer figures: the per-batch code's cost (the cheap loop's,
    # the same code) over the bare step, and its snapshot writes' CPU, one a second.
    real["estimate_ratio"] = 1 + cheap["loop_added_us"] / real["bare_us"] + real[
        "write_ms"] / 1e3
    print(f"\nrealistic, estimated: loop {cheap['loop_added_us']:+.2f} µs a batch over "
          f"{real['bare_us']:.0f} µs, and {real['write_ms']:.2f} ms of CPU a second for the "
          f"snapshot write: {real['estimate_ratio']:.4f}x (nan: no write in this run)")
    problems += check_same_data()
    epoch_bare, epoch_inst = epoch_start_us(50 if args.quick else 300)
    print(f"\nepoch start (iter() and first batch): bare {epoch_bare:.1f} µs, instrumented "
          f"{epoch_inst:.1f} µs ({epoch_inst - epoch_bare:+.1f} µs per epoch)\n"
          f"snapshot writes during instrumented loops: {len(writes)}, median {write_ms:.2f} ms "
          "of CPU;"
          f" benchmark took {perf_counter() - t0:.0f} s\n")
    checks = {
        f"cheap: added <= {MAX_ADDED_US:g} µs/batch": cheap["instrumented_added_us"]
        <= MAX_ADDED_US,
        f"cheap: ratio <= {MAX_CHEAP_RATIO:g}": cheap["instrumented_ratio"] <= MAX_CHEAP_RATIO,
        f"realistic: ratio < {MAX_RATIO:g}": real["instrumented_ratio"] < MAX_RATIO,
        f"realistic, estimated: ratio <= {MAX_REALISTIC_ESTIMATE:g}":
            real["estimate_ratio"] <= MAX_REALISTIC_ESTIMATE,
        # What a user pays for `with torch.profiler.profile(): loop`, spread per batch (the
        # in-loop part alone is printed above too, and is only a fraction of it).
        f"cheap: >= {MIN_CHEAPER:g}x cheaper than torch.profiler (with its exit)":
            cheap["cheaper_x_session"] >= MIN_CHEAPER,
        "same batches and data as the bare loader": not problems,
    }
    for problem in problems:
        print(f"  problem: {problem}")
    for label, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {label}")
    result = {"cheap": cheap, "realistic": {**real, "step_ms": step_s * 1e3},
              "epoch_start_us": {"bare": epoch_bare, "instrumented": epoch_inst},
              "writes": len(writes), "write_cpu_ms_median": write_ms, "quick": args.quick,
              "torch": torch.__version__, "python": platform.python_version(),
              "cpus": os.cpu_count(), "checks": checks}
    print(json.dumps(_rounded(result), sort_keys=True, ensure_ascii=False))
    return 1 if args.strict and not all(checks.values()) else 0


def _rounded(obj: Any) -> Any:
    """Floats to 4 places, infinities and nan to null, so the line stays strict JSON."""
    if isinstance(obj, float):
        return round(obj, 4) if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    return obj


if __name__ == "__main__":
    sys.exit(main())
