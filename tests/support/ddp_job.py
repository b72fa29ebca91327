"""A small data-parallel job for the tests, run by torchrun (gloo on CPU): a
DistributedSampler, one worker per rank, instrument.DataLoader, a DDP model whose
backward all-reduces, and a fixed "GPU" share of each step. One rank can be made the
input straggler (its samples cost more). Each rank measures its own truth: the seconds
it blocked in next() and the wall time of its loop, written to <out>/rank<R>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from prometheus_client.parser import text_string_to_metric_families
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, DistributedSampler

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat


class Samples(Dataset):  # type: ignore[type-arg]
    """Samples that take `cost` seconds each to load (I/O-like: a sleep)."""

    def __init__(self, n: int, cost: float) -> None:
        self.n, self.cost = n, cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.cost)
        return torch.full((8,), float(i % 7)), i % 2


def served_ranks(port: int, loader: str) -> list[str]:
    """The rank labels /metrics on this port serves for the loader."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sorted({s.labels["rank"] for f in text_string_to_metric_families(text)
                   for s in f.samples if s.name == cat.BATCHES.name
                   and s.labels.get("loader") == loader})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--loader", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--cost", type=float, default=0.0005, help="seconds a sample")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-cost", type=float, default=0.01)
    p.add_argument("--compute", type=float, default=0.02, help="the GPU's seconds a step")
    p.add_argument("--port", type=int, default=None, help="serve in-process: port= base")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ds = Samples(args.samples, args.slow_cost if rank == args.slow_rank else args.cost)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = instrument.DataLoader(ds, batch_size=args.batch_size, sampler=sampler,
                                   num_workers=1, persistent_workers=True, name=args.loader,
                                   port=args.port)
    model = DistributedDataParallel(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    blocked, batches = 0.0, 0
    dist.barrier()
    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        it = iter(loader)
        while True:
            t0 = time.perf_counter()
            try:
                x, y = next(it)
            except StopIteration:
                break
            blocked += time.perf_counter() - t0
            batches += 1
            time.sleep(args.compute)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()  # DDP all-reduces here: a fast rank waits for the slow one
            opt.step()
    wall = time.perf_counter() - start
    truth = {"rank": str(rank), "blocked": blocked, "wall": wall, "batches": batches,
             "local_rank": os.environ.get("LOCAL_RANK"),
             "local_world_size": os.environ.get("LOCAL_WORLD_SIZE")}
    dist.barrier()  # every rank still serves: see who answers on each local rank's port
    if args.port is not None:
        truth["served"] = {str(r): served_ranks(args.port + r, args.loader)
                           for r in range(int(os.environ["LOCAL_WORLD_SIZE"]))}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(truth))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
