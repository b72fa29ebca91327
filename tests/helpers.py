"""Tiny datasets and scrape helpers shared by the tests (importable by spawned workers)."""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
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


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    """A sample's value by catalogue name and labels (default loader/rank labels)."""
    return registry.get_sample_value(name, labels)


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Exposition text -> {(sample name, sorted labels): value}."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return parse(generate_latest(registry).decode())


_clock = itertools.count(10**9, 10)  # an injected clock: each check 10 s after the last


def refreshes(loader: Any, n: int = 3) -> None:
    """n worker-liveness checks of an instrumented loader, each past the one-second
    interval, so that a worker seen dead would be counted."""
    for _ in range(n):
        loader._dle.rec.flush(now=float(next(_clock)))


def wait_for_write(writer: Any, timeout: float = 5.0) -> bool:
    """Blocks until a SnapshotWriter completes a write begun after this call (one under
    way took its figures before: it does not count) and says whether it wrote."""
    written = writer.writes
    if not writer.wait_for(writer.ask(), timeout):
        return False
    return bool(writer.writes > written)


def deadline_poll(check: Any, timeout: float, interval: float = 0.05) -> Any:
    """Calls check() until it returns a truthy value or the deadline passes."""
    end = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > end:
            return result
        time.sleep(interval)


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` (root only; the test skips elsewhere)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True).returncode != 0:
        pytest.skip("needs root and mount to make a small filesystem")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
