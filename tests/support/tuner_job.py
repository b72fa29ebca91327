"""A small job for test_tuner_budgets.py: one loader named `train`, tuned as the test's
$DATALOADER_EXPORTER_SETTINGS asks (``train.num_workers=auto,...``), run for a few epochs,
alone or as one rank of a torchrun job (gloo on CPU, an all-reduce each step).

It writes what it saw to <out>/rank<R>.json: each epoch's settings once the tuner had
its say (the loader's num_workers and prefetch_factor after iter()), its wall time, the
budget the tuner reads (tuner_budget.budget()) and this process's resident memory then, the
tuner's log lines, and its metrics as this rank's registry exports them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry
from torch.utils.data import DistributedSampler

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.instrument.tuner import budget as tuner_budget
from support.torch_helpers import BurnDataset, SleepDataset

TUNER_METRICS = (cat.TUNER_CHANGES.name, cat.TUNER_STABLE.name)
SETUP = [0.0]  # CPU seconds each worker spends at its start (forked: set before)


def burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def setup_worker(worker_id: int) -> None:
    """A worker's own start: an index to read, a decoder to build."""
    burn(SETUP[0])


class Lines(logging.Handler):
    """The instrumentation's log lines, as the user reads them."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def own_rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tuner_samples(registry: CollectorRegistry) -> list[dict[str, Any]]:
    return [{"name": s.name, "labels": s.labels, "value": s.value}
            for family in registry.collect() for s in family.samples
            if s.name in TUNER_METRICS]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--samples", type=int, default=16, help="a batch of one each")
    p.add_argument("--cpu", type=float, default=0.0, help="CPU seconds a sample costs")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds a sample waits (I/O)")
    p.add_argument("--sample-bytes", type=int, default=16)
    p.add_argument("--worker-setup", type=float, default=0.0,
                   help="CPU seconds each worker spends at its start")
    p.add_argument("--step", type=float, default=0.01, help="seconds the loop's step takes")
    p.add_argument("--pin", action="store_true", help="this process on one CPU")
    p.add_argument("--ddp", action="store_true", help="a rank of a torchrun job")
    args = p.parse_args()

    if args.pin:  # its workers inherit the affinity
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    lines = Lines()
    logging.getLogger("dataloader_exporter.instrument").addHandler(lines)
    rank = 0
    if args.ddp:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    width = max(1, args.sample_bytes // 4)  # float32
    ds = (BurnDataset(args.samples, cpu=args.cpu, width=width) if args.cpu
          else SleepDataset(args.samples, delay=args.sleep, width=width))
    sampler: DistributedSampler[Any] | None = (
        DistributedSampler(ds, shuffle=False) if args.ddp else None)
    SETUP[0] = args.worker_setup
    registry = CollectorRegistry()
    loader = instrument.DataLoader(ds, batch_size=1, sampler=sampler,
                                   num_workers=args.workers, worker_init_fn=setup_worker,
                                   name="train", registry=registry)
    epochs = []
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        start = time.perf_counter()
        it = iter(loader)  # the tuner's change, if any, is applied here
        seen = {"epoch": epoch, "num_workers": loader.num_workers,
                "prefetch_factor": loader.prefetch_factor,
                "budget": dataclasses.asdict(tuner_budget.budget()), "rss": own_rss()}
        batches = 0
        for _ in it:
            batches += 1
            time.sleep(args.step)
            if args.ddp:
                dist.all_reduce(torch.ones(1))  # every step waits for the slowest rank
        epochs.append({**seen, "batches": batches, "seconds": time.perf_counter() - start})
    truth = {"rank": rank, "epochs": epochs, "log": lines.lines,
             "metrics": tuner_samples(registry)}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(truth))
    if args.ddp:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
