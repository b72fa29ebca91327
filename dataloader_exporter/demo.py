"""`dataloader-exporter demo`: the whole loop on a laptop with no GPU.

A real training loop on the CPU over a synthetic dataset whose samples cost real CPU
work (rendering and filtering a noisy image). First a starved configuration
(num_workers=0, no persistent workers), then the settings the doctor recommends for it,
then a loader that tunes itself (num_workers, prefetch_factor and persistent_workers)
from num_workers=0, all instrumented, while /metrics is served on 127.0.0.1. It ends
with a side-by-side table. The main process uses one torch thread, as DataLoader workers
do, so the runs share the machine's cores the same way. The speed-ups are judged against
the machine as it is: before and after the runs the demo measures what two processes
rendering these samples at once give against one (``machine_limit``), and prints each
speed-up beside it, and for each run how much CPU other processes used meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import psutil
import torch
import torch.nn.functional as F
from prometheus_client import generate_latest
from torch import nn
from torch.utils.data import Dataset

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.core.settings import TUNABLE
from dataloader_exporter.diagnosis.doctor import Diagnosis, diagnose
from dataloader_exporter.diagnosis.machine import local_machine
from dataloader_exporter.diagnosis.signals import Scrape, Window, loaders
from dataloader_exporter.instrument.rank import current_rank
from dataloader_exporter.instrument.tuner.epoch import MIN_BATCHES

BATCH = 32
UNSETTLED = 24  # epochs after which a tuner that has not settled is measured as it is
WORK = 8  # filter passes per sample: about 1.2 ms of CPU, close to a step's cost per sample
LIMIT_SECONDS = 0.15  # a turn of the limit's measurement: about 100 samples a process
LIMIT_ROUNDS = 4  # turns alone and together each: about 1.3 s in all


class NoisyImages(Dataset[tuple[torch.Tensor, int]]):
    """3x64x64 images rendered and filtered on demand, with a label."""

    def __init__(self, n: int, work: int = WORK) -> None:
        self.n, self.work = n, work

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        img = torch.rand(3, 64, 64, generator=g)
        for _ in range(self.work):  # stands in for decoding and augmentation
            img = F.avg_pool2d(img.unsqueeze(0), 3, 1, 1).squeeze(0)
            img = (img + 0.05 * torch.randn(img.shape, generator=g)).clamp(0, 1)
        return img, i % 10


def model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 12, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(12, 12, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(8),
                         nn.Flatten(), nn.Linear(12 * 64, 10))


def train_step(net: nn.Module, opt: torch.optim.Optimizer, loader: Any,
               batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One SGD step on a batch moved through the loader's timed to_device; the loss."""
    x, y = loader.to_device(batch, "cpu")
    loss = F.cross_entropy(net(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


@dataclass
class Result:
    name: str
    settings: dict[str, Any]  # the settings its measured epochs ran with
    samples_per_second: float  # over its measured epochs, each from iter() to its last step
    epoch_seconds: float
    first_batch_seconds: float
    stall_share: float | None
    diagnosis: Diagnosis
    measured: str  # which epochs the figures are over
    others_cpu: float  # cores other processes kept busy meanwhile


def cpu_clock() -> tuple[float, float, float]:
    """(monotonic time, the machine's busy CPU seconds, those of this process and its
    children, reaped or alive): two readings tell how much CPU others used between them."""
    me = psutil.Process()
    ours = 0.0
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):  # reaped since: counted in me's below
            t = child.cpu_times()
            ours += t.user + t.system
    t = me.cpu_times()
    ours += t.user + t.system + t.children_user + t.children_system
    m = psutil.cpu_times()  # guest time is within user time already
    idle = m.idle + sum(getattr(m, f, 0.0) for f in ("iowait", "guest", "guest_nice"))
    return time.monotonic(), sum(m) - idle, ours


def others_cores(start: tuple[float, float, float], end: tuple[float, float, float]) -> float:
    """Cores' worth of CPU that other processes (and other VMs' steal) used between two
    `cpu_clock` readings."""
    busy, ours = end[1] - start[1], end[2] - start[2]
    return max(0.0, busy - ours) / max(end[0] - start[0], 1e-9)


def _progress(line: str, final: bool = False) -> None:
    if sys.stdout.isatty():
        print("\r" + line.ljust(100), end="\n" if final else "", flush=True)
    elif final:
        print(line, flush=True)


def tuner_settled(registry: Any, name: str) -> bool:
    """Whether the loader's tuner has settled, from its registry (read after iter(),
    where it decides); the convergence bench reads it the same way."""
    rank = current_rank()
    return any(s.value == 1.0 for f in registry.collect() if f.name == cat.TUNER_STABLE.name
               for s in f.samples
               if s.labels.get("loader") == name and s.labels.get("rank") == rank)


def run_phase(name: str, settings: dict[str, Any], seconds: float, samples: int,
              tune: bool = False) -> Result:
    """Trains whole epochs until `seconds` have passed and two measured epochs are done.

    A tuned loader's figures are over the epochs after its tuner settled (it changes
    settings only at iter()), so it may run past `seconds`."""
    registry = instrument.default_registry()
    # Generic like torch's DataLoader (mypy checks this line in `make typecheck`).
    loader: instrument.DataLoader[tuple[torch.Tensor, int]] = instrument.DataLoader(
        NoisyImages(samples), batch_size=BATCH, shuffle=True, name=name,
        tune=TUNABLE if tune else False, **settings)  # every setting the tuner sets
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    begin = time.perf_counter()
    before: Scrape | None = None  # at the first measured epoch's start
    walls: list[float] = []  # per epoch: iter() to its last step
    clocks: list[tuple[float, float, float]] = []  # per epoch: cpu_clock() at its start
    counts: list[int] = []
    first = 0  # the first measured epoch
    last_print = 0.0
    scrape = Scrape.parse(generate_latest(registry).decode())  # at the next epoch's start
    while before is None or len(walls) - first < 2 or time.perf_counter() - begin < seconds:
        if before is None and walls:
            if len(walls) == UNSETTLED:  # never seen here: measure the last epoch
                before, first = scrape, len(walls) - 1
                break
            scrape = Scrape.parse(generate_latest(registry).decode())
        clocks.append(cpu_clock())
        start = time.perf_counter()
        epoch = iter(loader)  # where the tuner changes the settings, or settles
        if before is None and (not tune or tuner_settled(registry, name)):
            before, first = scrape, len(walls)
        seen = 0
        for batch in epoch:
            loss = train_step(net, opt, loader, batch)
            seen += len(batch[1])
            now = time.perf_counter()
            if now - last_print > 0.5:
                last_print = now
                rate = (sum(counts) + seen) / (now - begin)
                _progress(f"[{name}] epoch {len(walls) + 1}: {rate:6.0f} samples/s, "
                          f"loss {loss.item():.3f}")
        walls.append(time.perf_counter() - start)
        counts.append(seen)
    assert before is not None
    others = others_cores(clocks[first], cpu_clock())
    after = Scrape.parse(generate_latest(registry).decode())
    window = Window.between(before, after)
    sig = next(s for s in loaders(window) if s.loader == name)
    diag = diagnose(sig, local_machine("."))
    n, wall = len(walls) - first, sum(walls[first:])
    rate = sum(counts[first:]) / wall
    measured = (f"all {n} epochs" if not tune else
                f"last {n} of {len(walls)} epochs, settled" if tuner_settled(registry, name) else
                f"last {n} of {len(walls)} epochs, still tuning")
    used = settings
    if tune:  # what its measured epochs ran with
        used = {"num_workers": loader.num_workers}
        if loader.num_workers:
            used["prefetch_factor"] = loader.prefetch_factor
            used["persistent_workers"] = loader.persistent_workers
    _progress(f"[{name}] {len(walls)} epochs, {rate:.0f} samples/s over {measured}",
              final=True)
    del loader, epoch  # shut persistent workers down before the next phase
    return Result(name, used, rate, wall / n, sig.first_batch_mean or 0.0,
                  sig.stall_share, diag, measured, others)


def _renderer(jobs: Connection, parents_end: Connection) -> None:
    """A child: for each `seconds` it receives, renders samples that long and answers its
    samples/s, until the parent closes its end or is gone. Ctrl-C is the parent's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    parents_end.close()  # so that a parent's death reads as EOF here
    torch.set_num_threads(1)
    data = NoisyImages(2**62)
    data[0]  # the first sample pays for lazy set-up
    try:
        while True:
            seconds = jobs.recv()
            start = now = time.monotonic()
            n = 0
            while now - start < seconds:
                data[n]
                n += 1
                now = time.monotonic()
            jobs.send(n / (now - start))
    except (EOFError, OSError):
        pass


def machine_limit(seconds: float = LIMIT_SECONDS, rounds: int = LIMIT_ROUNDS) -> float | None:
    """How many times one process's samples/s two processes rendering the demo's samples
    at once reach on this machine now (2.0 on two idle cores; less beside other work).

    Two forked children take turns: one alone, then both at once, `rounds` times for
    `seconds` each, the order alternating so that a load that comes or goes counts on
    both sides. No child outlives the call, whatever ends it. None where it cannot be
    measured (no fork, a child failed)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return None
    ctx = multiprocessing.get_context("fork")
    ends: list[Connection] = []
    children = []
    one = two = 0.0
    try:
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # until ignored
        try:
            for _ in range(2):
                mine, theirs = ctx.Pipe()
                children.append(ctx.Process(target=_renderer, args=(theirs, mine),
                                            daemon=True))
                children[-1].start()
                theirs.close()
                ends.append(mine)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for i in range(2 * rounds):
            together = ends if i % 4 in (1, 2) else ends[:1]
            for end in together:
                end.send(seconds)
            rates = [end.recv() for end in together]
            if len(together) == 2:
                two += sum(rates)
            else:
                one += rates[0]
    except (EOFError, OSError):
        return None
    finally:
        for end in ends:
            end.close()
        for child in children:  # idle between turns, or interrupted: nothing left to save
            child.terminate()
            child.join()
    return two / one if one > 0 else None


@dataclass(frozen=True)
class Limit:
    """The machine's limit (`machine_limit`) just before and just after the runs."""
    before: float | None
    after: float | None

    @property
    def ratio(self) -> float | None:
        """The mean of the two: the load the runs met, as well as it is known."""
        known = [r for r in (self.before, self.after) if r is not None]
        return sum(known) / len(known) if known else None

    def line(self) -> str:
        """The line under the table that says what the limit is."""
        if self.ratio is None:
            return "this machine's limit: not measured (no fork here, or a child failed)"
        told = ", ".join(f"{r:.2f}x {when}" for r, when in
                         ((self.before, "before the runs"), (self.after, "after"))
                         if r is not None)
        return (f"of {self.ratio:.2f}x: this machine's limit, what two processes gave "
                f"against one, rendering these samples ({told})")


def recommended(diag: Diagnosis) -> dict[str, Any]:
    """The DataLoader keyword arguments the doctor recommends (those a CPU run can use)."""
    out: dict[str, Any] = {}
    for r in diag.recommendations:
        if r.setting in ("num_workers", "prefetch_factor"):
            out[r.setting] = int(r.value)
        elif r.setting in ("persistent_workers", "pin_memory"):
            out[r.setting] = r.value == "True"
    if not out.get("num_workers"):
        out.pop("prefetch_factor", None)
        out.pop("persistent_workers", None)
    return out


def speedups(results: list[Result], limit: float | None) -> list[str]:
    """Each column's samples/s over the first column's, beside the machine's limit."""
    of = f" of {limit:.2f}x" if limit is not None else ""
    base = results[0].samples_per_second
    return [f"{r.samples_per_second / base:.2f}x" + (of if i else "")
            for i, r in enumerate(results)]


def table(results: list[Result], limit: float | None = None) -> str:
    rows = [("", *(r.name for r in results)),
            ("settings", *(", ".join(f"{k}={v}" for k, v in r.settings.items()) or "defaults"
                           for r in results)),
            ("input stall share", *(f"{r.stall_share:.0%}" if r.stall_share is not None
                                    else "-" for r in results)),
            ("samples/s", *(f"{r.samples_per_second:.0f}" for r in results)),
            ("speed-up", *speedups(results, limit)),
            ("measured over", *(r.measured for r in results)),
            ("others' CPU use", *(f"{r.others_cpu:.1f} of {psutil.cpu_count() or '?'} cores"
                                  for r in results)),
            ("epoch time", *(f"{r.epoch_seconds:.2f} s" for r in results)),
            ("time to first batch", *(f"{r.first_batch_seconds * 1000:.0f} ms"
                                      for r in results)),
            ("doctor's verdict", *(r.diagnosis.verdict for r in results))]
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True))
                     for row in rows)


DESCRIPTION = ("A starved and a tuned CPU training run, side by side, with the doctor's "
               "advice applied between them, and a third that tunes itself (num_workers, "
               "prefetch_factor and persistent_workers=auto) "
               "(needs the torch extra).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=60.0,
                   help="seconds of training in all, split between the three runs (default 60; "
                        "the self-tuning run goes on until two epochs after it settles)")
    p.add_argument("--port", type=int, default=9478,
                   help="serve /metrics on 127.0.0.1:PORT meanwhile (0: any free port)")
    p.add_argument("--samples", type=int, default=1024,
                   help=f"samples per epoch (at least {MIN_BATCHES * BATCH}: the tuner "
                        f"judges epochs of {MIN_BATCHES} batches or more)")
    p.add_argument("--keep-serving", action="store_true",
                   help="keep serving /metrics after the runs, until Ctrl-C")


def _measure_limit(when: str) -> float | None:
    _progress(f"this machine's limit {when}: samples rendered by one process, then by two "
              "at once ...")
    ratio = machine_limit()
    told = f"{ratio:.2f}x one's samples/s" if ratio is not None else "not measured"
    _progress(f"this machine's limit {when}: two processes at once gave {told}", final=True)
    return ratio


def run(args: argparse.Namespace) -> int:
    if (args.duration <= 0 or args.samples < MIN_BATCHES * BATCH
            or not 0 <= args.port <= 65535):
        print("dataloader-exporter demo: --duration must be positive, --samples at least "
              f"{MIN_BATCHES * BATCH}, --port 0-65535", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    try:
        server = instrument.serve(args.port, addr="127.0.0.1")
    except OSError as e:
        print(f"dataloader-exporter demo: cannot serve on port {args.port}: {e}",
              file=sys.stderr)
        return 2
    print(f"serving /metrics at {server.url}/metrics (point a Prometheus or "
          f"`dataloader-exporter top --url {server.url}/metrics` at it)", flush=True)
    before = _measure_limit("before the runs")
    third = args.duration / 3
    starved = run_phase("starved", {"num_workers": 0}, third, args.samples)
    print("\ndoctor on the starved run:")
    for f in starved.diagnosis.findings:
        print(f"  ! {f.message}")
    for r in starved.diagnosis.recommendations:
        print(f"  {r.setting}={r.value}: {r.why}")
    tuned = run_phase("tuned", recommended(starved.diagnosis), third, args.samples)
    print("\nauto: from num_workers=0, the loader tunes itself (tune=num_workers, "
          "prefetch_factor, persistent_workers)",
          flush=True)
    auto = run_phase("auto", {"num_workers": 0}, third, args.samples, tune=True)
    limit = Limit(before, _measure_limit("after the runs"))
    print()
    print(table([starved, tuned, auto], limit.ratio))
    print()
    print(limit.line())
    print(f"auto: {auto.samples_per_second / tuned.samples_per_second:.2f}x the doctor's "
          "settings' samples/s")
    if args.keep_serving:
        print(f"still serving {server.url}/metrics; Ctrl-C to stop", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    server.shutdown()
    return 0
