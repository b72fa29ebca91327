"""The floor under the cheap loop: what any per-batch timing written in Python costs.

bench/overhead.py's cheapest loop (TensorDataset, batch_size=1, num_workers=0, empty loop
body) measures instrument.DataLoader against a bare loop. This asks how much of that is the
instrumentation's own choice: in one process, rounds interleaved with their order rotated,
the same torch iterator wrapped four ways:

  bare          torch's iterator as it is
  wrapper       an iterator class whose __next__ only calls next() on torch's: the Python
                frame any wrapper adds (a hook on torch's own __next__ would add it too)
  floor         that wrapper plus what timing a batch cannot do without: two
                perf_counter_ns calls and one append of the pair to a deque
  instrumented  instrument.DataLoader's iterator (no snapshot writes: the loop alone), its
                per-batch path in C (instrument/hotpath/_hotpath.c); with
                DATALOADER_EXPORTER_PURE_PYTHON=1 set, the same in Python

µs per batch, medians of rounds; added µs paired within a round. A per-batch path written
in Python cannot cost less than the floor; in C it has no Python frame of its own.

    python bench/hot_floor.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import collections
import gc
import logging
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from time import perf_counter_ns
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from prometheus_client import CollectorRegistry
from torch.utils.data import DataLoader, TensorDataset

from dataloader_exporter import instrument
from dataloader_exporter.instrument.hotpath import base as hotpath_base

BATCHES = 2000  # per round and variant


class Wrapper:
    __slots__ = ("it",)

    def __init__(self, it: Iterator[Any]) -> None:
        self.it = it

    def __iter__(self) -> Wrapper:
        return self

    def __next__(self) -> Any:
        return next(self.it)


class Floor(Wrapper):
    __slots__ = ("times",)

    def __init__(self, it: Iterator[Any]) -> None:
        super().__init__(it)
        self.times: collections.deque[tuple[int, int]] = collections.deque(maxlen=1 << 16)

    def __next__(self) -> Any:
        t0 = perf_counter_ns()
        batch = next(self.it)
        self.times.append((t0, perf_counter_ns()))
        return batch


def loop(it: Iterator[Any]) -> float:
    """µs per batch over BATCHES batches."""
    t0 = perf_counter_ns()
    for i, _ in enumerate(it, 1):
        if i == BATCHES:
            break
    return (perf_counter_ns() - t0) / 1e3 / BATCHES


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few rounds, for a smoke run")
    ap.add_argument("--rounds", type=int, default=0, help="rounds (default 150)")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (8 if args.quick else 150)
    logging.getLogger("dataloader_exporter.instrument").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    n = (args.rounds + 2) * BATCHES
    ds = TensorDataset(torch.randn(n, 16), torch.arange(n))
    its: dict[str, Iterator[Any]] = {
        "bare": iter(DataLoader(ds, batch_size=1)),
        "wrapper": Wrapper(iter(DataLoader(ds, batch_size=1))),
        "floor": Floor(iter(DataLoader(ds, batch_size=1))),
        "instrumented": iter(instrument.DataLoader(ds, batch_size=1, name="floor",
                                                   registry=CollectorRegistry())),
    }
    names = list(its)
    for it in its.values():  # warm-up: first batches
        loop(it)
    gc.freeze()
    out: dict[str, list[float]] = {k: [] for k in names}
    for r in range(args.rounds):
        order = names[r % 4:] + names[:r % 4]
        for k in order if r % 2 else order[::-1]:
            out[k].append(loop(its[k]))
    bare = out["bare"]
    print(f"torch {torch.__version__}, {args.rounds} rounds of {BATCHES} batches, "
          f"batch_size=1, empty loop body: µs per batch (medians), added µs paired by round; "
          f"the per-batch path in {'C' if hotpath_base.NATIVE else 'Python'}")
    for k in names:
        added = statistics.median(a - b for a, b in zip(out[k], bare, strict=True))
        ratio = statistics.median(a / b for a, b in zip(out[k], bare, strict=True))
        print(f"  {k:<14}{statistics.median(out[k]):8.2f} {added:+7.2f}  {ratio:.4f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
