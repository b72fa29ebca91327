"""What instrumentation costs a short-lived loader: built, run for one short epoch, dropped.

One process, variants interleaved in rounds, each round in its own shuffled order (no
variant always runs after another: an epoch's workers still exiting slow the next), so the
machine's noise hits all alike; medians over rounds, added ms and ratios paired within a
round, 90% bootstrap intervals of the median. Each round of a variant builds a loader over the same
TensorDataset and takes one epoch of 8 batches (batch_size=8):

  bare          torch's DataLoader, its own __init__ and __iter__ (the hooks that
                instrumentation puts on the class are taken off for these rounds)
  instrumented  instrument.DataLoader (no snapshot directory: registries are local)
  zero-code     torch's DataLoader with the hooks of `dataloader-exporter run` on (what its
                sitecustomize installs: zerocode_hooks.install(auto=True)), each loader
                named from its construction site as in a real run
  bare again    bare once more: an A/A control, whose ratio to bare is the resolution of
                the method (a target ratio within it cannot be told from noise)

in two cases: num_workers=0, and num_workers=2 (workers started and shut down each epoch;
--workers N for another count: with 1, three processes no longer share 2 cores).
Targets: +0.2 ms at most without workers, 1.02x at most with workers. --phases: where the
case with workers adds its time instead: each round cut at the forks, iter()'s return, the
first batch and the end, with this process's page faults in each part (after a fork, a page
written faults once: copied while a worker still shares it). --functions: the Python
functions a round runs beyond bare's, a count that does not vary with the machine's load.

    python bench/short_lived.py [--quick] [--strict] [--rounds N] [--workers N]
                                [--phases | --functions]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import logging
import os
import platform
import random
import resource
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from time import perf_counter, perf_counter_ns
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.utils.data import DataLoader, TensorDataset

from dataloader_exporter import instrument
from dataloader_exporter.core.envnames import ENV_DIR
from dataloader_exporter.instrument.torch_originals import TORCH_INIT, TORCH_ITER
from dataloader_exporter.instrument.zerocode import hooks as zerocode_hooks
from dataloader_exporter.instrument.zerocode import registry as zerocode_registry

ROOT = Path(__file__).resolve().parent.parent  # the checkout, put first on sys.path above
MAX_ADDED_MS = 0.2  # without workers
MAX_RATIO = 1.02  # with workers
# "bare again" is bare once more, an A/A control: its ratio to bare is the method's own
# resolution, which a ratio target below it cannot be told from.
VARIANTS = ("bare", "instrumented", "zero-code", "bare again")
MEASURED = ("instrumented", "zero-code")
# Per variant: how its loader is built, and the class hooks on (and zero-code mode's too).
MAKERS: dict[str, tuple[Callable[..., Any], bool, bool]] = {
    "bare": (DataLoader, False, False),
    "instrumented": (instrument.DataLoader, True, False),
    "zero-code": (DataLoader, True, True),
    "bare again": (DataLoader, False, False),
}
_HOOKED: dict[str, Any] = {}


def hooks(on: bool, auto: bool = False) -> None:
    """torch's DataLoader with the instrumentation's class hooks (auto: zero-code mode's
    too) or with torch's own __init__ and __iter__ (a process without instrumentation)."""
    if not _HOOKED:
        zerocode_hooks.install()
        _HOOKED.update({k: vars(DataLoader)[k] for k in ("__init__", "__iter__")})
    DataLoader.__init__ = _HOOKED["__init__"] if on else TORCH_INIT  # type: ignore[method-assign]
    DataLoader.__iter__ = _HOOKED["__iter__"] if on else TORCH_ITER  # type: ignore[method-assign]
    zerocode_registry.Mode.auto = on and auto


def one_epoch(make: Callable[..., Any], ds: TensorDataset, workers: int) -> float:
    """ms to build a loader and take one epoch of it, and to drop it."""
    t0 = perf_counter_ns()
    loader = make(ds, batch_size=8, num_workers=workers)
    for _batch in loader:
        pass
    del loader
    return (perf_counter_ns() - t0) / 1e6


PHASES = ("build, to the first fork", "the forks", "after them, to iter()'s return",
          "the first batch", "the other batches", "the drop")
_FORK = os.fork


def _mark() -> tuple[int, int]:
    return perf_counter_ns(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def phased_epoch(make: Callable[..., Any], ds: TensorDataset, workers: int
                 ) -> list[tuple[float, int]]:
    """one_epoch in PHASES: (ms, this process's page faults) in each (workers > 0)."""
    forks: list[tuple[int, int]] = []

    def fork() -> int:  # what multiprocessing calls to start each worker
        if not forks:
            forks.append(_mark())
        pid = _FORK()
        if pid:  # this process: after the last fork so far
            forks[1:] = [_mark()]
        return pid

    os.fork = fork
    try:
        marks = [_mark()]
        loader = make(ds, batch_size=8, num_workers=workers)
        it = iter(loader)
        marks += [*forks, _mark()]
        next(it)
        marks.append(_mark())
        for _batch in it:
            pass
        marks.append(_mark())
        del it, loader
        marks.append(_mark())
    finally:
        os.fork = _FORK
    return [((b[0] - a[0]) / 1e6, b[1] - a[1]) for a, b in itertools.pairwise(marks)]


def phases(rounds: int, workers: int = 2) -> None:
    """Prints where the case with workers adds time and page faults (paired medians)."""
    times = run_case(workers, rounds, phased_epoch)
    print(f"\nnum_workers={workers} in phases ({rounds} rounds): bare, and what each variant adds "
          "(ms, page faults; medians paired within a round)")
    print(f"  {'':<32}{'bare':>16}" + "".join(f"{v:>21}" for v in VARIANTS[1:]))
    bare = times["bare"]
    for i, name in enumerate(PHASES):
        line = (f"  {name:<32}{statistics.median(r[i][0] for r in bare):9.3f} ms"
                f"{statistics.median(r[i][1] for r in bare):5.0f}")
        for v in VARIANTS[1:]:
            pairs = list(zip(times[v], bare, strict=True))
            ms = statistics.median(t[i][0] - b[i][0] for t, b in pairs)
            faults = statistics.median(t[i][1] - b[i][1] for t, b in pairs)
            line += f"{ms:+12.3f} ms{faults:+6.0f}"
        print(line)


# torch's SIGCHLD handler, run in some rounds only, as a worker's exit falls.
_SIGNALS = ("torch/utils/data/_utils/signal_handling.py",)


def functions(workers: int = 2) -> dict[str, list[str]]:
    """Per measured variant, the Python functions each of its rounds runs (three, after
    warm-up rounds) that no round of bare's does, as "path:line name". A page written
    after a fork faults once; each function run writes its own object and its code's
    (their reference counts and the interpreter's inline caches), so this count, unlike a
    time, is the same on a busy machine."""
    ds = TensorDataset(torch.randn(64, 16), torch.arange(64))
    ran: dict[str, set[str]] = {}
    root = str(ROOT) + os.sep
    for variant in ("bare", *MEASURED):
        make, on, auto = MAKERS[variant]
        hooks(on, auto)
        for _ in range(3):
            one_epoch(make, ds, workers)
        rounds: list[set[str]] = []
        for _ in range(3):
            seen: set[str] = set()

            def called(frame: Any, event: str, _arg: Any, seen: set[str] = seen) -> None:
                code = frame.f_code
                if event == "call" and not code.co_filename.endswith(_SIGNALS):
                    seen.add(f"{code.co_filename.replace(root, '')}:{code.co_firstlineno} "
                             f"{code.co_name}")

            sys.setprofile(called)
            try:
                one_epoch(make, ds, workers)
            finally:
                sys.setprofile(None)
            rounds.append(seen)
        ran[variant] = (set.union if variant == "bare" else set.intersection)(*rounds)
    hooks(False)
    return {v: sorted(ran[v] - ran["bare"]) for v in MEASURED}


def run_case(workers: int, rounds: int, epoch: Callable[..., Any] = one_epoch
             ) -> dict[str, list[Any]]:
    """Per variant, per round: ms for build + one epoch (or what `epoch` returns)."""
    ds = TensorDataset(torch.randn(64, 16), torch.arange(64))
    for make, on, auto in MAKERS.values():  # warm-up: imports, first-use caches
        hooks(on, auto)
        epoch(make, ds, workers)
    out: dict[str, list[Any]] = {v: [] for v in VARIANTS}
    shuffle = random.Random(workers)  # a fixed order of orders: reruns alike
    for _ in range(rounds):
        order = list(VARIANTS)
        shuffle.shuffle(order)  # no variant always follows another
        for v in order:
            make, on, auto = MAKERS[v]
            hooks(on, auto)
            out[v].append(epoch(make, ds, workers))
    hooks(False)
    return out


def bootstrap_interval(xs: list[float], reps: int = 2000) -> tuple[float, float]:
    """90% bootstrap interval of the median of xs (fixed seed: reruns print the same)."""
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(reps))
    return meds[reps // 20], meds[reps - reps // 20 - 1]


def summarize(times: dict[str, list[float]]) -> dict[str, Any]:
    bare = times["bare"]
    s: dict[str, Any] = {"bare_ms": statistics.median(bare)}
    for v in VARIANTS[1:]:
        added = [t - b for t, b in zip(times[v], bare, strict=True)]
        ratio = [t / b for t, b in zip(times[v], bare, strict=True)]
        s[v] = {"ms": statistics.median(times[v]), "added_ms": statistics.median(added),
                "added_ms_90": bootstrap_interval(added), "ratio": statistics.median(ratio),
                "ratio_90": bootstrap_interval(ratio)}
    return s


def report(name: str, rounds: int, s: dict[str, Any]) -> None:
    print(f"\n{name} ({rounds} rounds): build + one epoch of 8 batches, ms (medians)")
    print(f"  {'bare':<14}{s['bare_ms']:9.3f}")
    for v in VARIANTS[1:]:
        f = s[v]
        lo, hi = f["added_ms_90"]
        rlo, rhi = f["ratio_90"]
        print(f"  {v:<14}{f['ms']:9.3f} {f['added_ms']:+8.3f} ms (90% {lo:+.3f} .. {hi:+.3f})"
              f"  {f['ratio']:.4f}x (90% {rlo:.4f} .. {rhi:.4f})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few rounds, for a smoke run")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    ap.add_argument("--rounds", type=int, default=0, help="rounds per case (default 300/600)")
    ap.add_argument("--phases", action="store_true",
                    help="where the case with workers adds its time, instead of the checks")
    ap.add_argument("--functions", action="store_true",
                    help="the Python functions a round with workers runs beyond bare's, "
                    "instead")
    ap.add_argument("--workers", type=int, default=2,
                    help="workers in the case with workers (default 2)")
    args = ap.parse_args(argv)
    if args.workers < 1:
        ap.error("--workers: at least 1 (the case without workers always runs)")
    logging.getLogger("dataloader_exporter.instrument").setLevel(logging.ERROR)
    os.environ.pop(ENV_DIR, None)  # no snapshot thread: registries stay local
    torch.set_num_threads(1)
    t0 = perf_counter()
    gc.freeze()  # a full collection over torch's objects would land in one variant
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} "
          f"CPUs, 1 torch thread")
    r0 = args.rounds or (30 if args.quick else 300)
    # 600 rounds of 2 workers: the median's 90% interval spans about +-1% (150: +-2%,
    # wider than the distance from the target it is to be told from).
    r2 = args.rounds or (6 if args.quick else 600)
    if args.phases:
        phases(r2, args.workers)
        return 0
    if args.functions:
        for variant, names in functions(args.workers).items():
            print(f"\n{variant}: {len(names)} functions more than bare's in one round")
            for name in names:
                print(f"  {name}")
        return 0
    no_workers = summarize(run_case(0, r0))
    report("num_workers=0", r0, no_workers)
    workers = summarize(run_case(args.workers, r2))
    report(f"num_workers={args.workers}", r2, workers)
    checks = {}
    for v in MEASURED:
        checks[f"{v}, no workers: added <= {MAX_ADDED_MS:g} ms"] = (
            no_workers[v]["added_ms"] <= MAX_ADDED_MS)
        checks[f"{v}, {_workers(args.workers)}: ratio <= {MAX_RATIO:g}"] = (
            workers[v]["ratio"] <= MAX_RATIO)
    print(f"\nbenchmark took {perf_counter() - t0:.0f} s")
    for label, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {label}")
    result = {"workers_0": no_workers, f"workers_{args.workers}": workers, "quick": args.quick,
              "torch": torch.__version__, "python": platform.python_version(),
              "cpus": os.cpu_count(), "checks": checks}
    print(json.dumps(_rounded(result), sort_keys=True))
    return 1 if args.strict and not all(checks.values()) else 0


def _workers(n: int) -> str:
    return f"{n} worker{'s' if n != 1 else ''}"


def _rounded(obj: Any) -> Any:
    """Floats to 4 places, so the line stays short."""
    if isinstance(obj, float):
        return round(obj, 4)
    if isinstance(obj, (list, tuple)):
        return [_rounded(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    return obj


if __name__ == "__main__":
    sys.exit(main())
