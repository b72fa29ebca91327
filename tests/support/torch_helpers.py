"""Tiny torch datasets shared by the tests (importable by spawned workers). The tests'
torch-free helpers are in helpers.py: the modules not marked torch, which run without
torch, must not import this one."""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class SleepDataset(Dataset):  # type: ignore[type-arg]
    """n samples of `width` floats; each __getitem__ sleeps `delay` seconds."""

    def __init__(self, n: int, delay: float = 0.0, width: int = 4) -> None:
        self.n, self.delay, self.width = n, delay, width

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        if self.delay:
            time.sleep(self.delay)
        return torch.full((self.width,), float(i)), i


class BurnDataset(SleepDataset):
    """Like SleepDataset, but each __getitem__ spends `cpu` seconds of CPU time."""

    def __init__(self, n: int, cpu: float = 0.0, width: int = 4) -> None:
        super().__init__(n, 0.0, width)
        self.cpu = cpu

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        end = time.process_time() + self.cpu
        while time.process_time() < end:
            pass
        return super().__getitem__(i)


class FailingDataset(SleepDataset):
    """Raises ValueError at index `bad`."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i == self.bad:
            raise ValueError(f"corrupt sample {i}")
        return super().__getitem__(i)


class RangeIterable(IterableDataset):  # type: ignore[type-arg]
    """0..n-1, sharded across workers; optional __len__."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield torch.tensor([i])


class SizedRangeIterable(RangeIterable):
    def __len__(self) -> int:
        return self.n


class WhoAmI(Dataset):  # type: ignore[type-arg]
    """Each sample says which dataset object the worker's torch sees, and whether it
    passes the user's isinstance check (the usual pattern for per-worker sharding)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, str, bool]:
        info = get_worker_info()
        seen = None if info is None else info.dataset
        return i, type(seen).__qualname__, isinstance(seen, WhoAmI)


class WhoAmIIterable(IterableDataset):  # type: ignore[type-arg]
    """The iterable kind of WhoAmI, sharded by worker the usual way."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = get_worker_info()
        if info is not None and not isinstance(info.dataset, WhoAmIIterable):
            raise TypeError(f"worker sees {type(info.dataset).__qualname__}")
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            seen = None if info is None else info.dataset
            yield i, type(seen).__qualname__


class GetItemsDataset(SleepDataset):
    """A map-style dataset that fetches whole batches through __getitems__, as torch
    asks when it exists; each call is logged in the sample it returns."""

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        return [(torch.full((self.width,), float(i)), len(indices)) for i in indices]


def write_real_snapshot(rank: str = "0", loaders: Sequence[tuple[str, int]] = (("t", 2),),
                        batches: int = 4, to_device_first: str | None = None,
                        exited: bool = False) -> bytes:
    """What a trainer process of `rank` running `loaders` (name, num_workers) writes to
    its snapshot file, written now by instrument's own SnapshotWriter (see
    real_snapshots.real_snapshot, which reads the committed copies of these)."""
    from prometheus_client import CollectorRegistry

    from dataloader_exporter import instrument
    from dataloader_exporter.instrument.hub import hub_for

    saved = os.environ.get("RANK")
    os.environ["RANK"] = rank
    # no advice in test logs
    logging.getLogger("dataloader_exporter.instrument").setLevel(logging.ERROR)
    try:
        registry = CollectorRegistry()
        for name, workers in loaders:
            loader = instrument.DataLoader(SleepDataset(batches), batch_size=1, name=name,
                                           num_workers=workers, registry=registry)
            if name == to_device_first:
                loader.to_device(SleepDataset(1)[0][0], "cpu")
                continue
            for x, _ in loader:
                loader.to_device(x, "cpu")
        with tempfile.TemporaryDirectory() as directory:
            writer = hub_for(registry).write_snapshots(directory, interval=3600)
            if exited:
                hub_for(registry).exiting()
            writer.close()  # stops the thread after one last write
            return Path(writer.path).read_bytes()
    finally:
        logging.getLogger("dataloader_exporter.instrument").setLevel(logging.NOTSET)
        if saved is None:
            os.environ.pop("RANK", None)
        else:
            os.environ["RANK"] = saved
