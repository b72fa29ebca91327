"""Worker processes report to their main process through a small shared-memory block.

Each worker owns one row of an int64 tensor placed in shared memory before the
workers start: busy nanoseconds, samples, last-sample wall time (ns) and its pid.
The block travels to workers through public DataLoader hooks only: a chained
``worker_init_fn`` (binds the row), a dataset wrapper (times each sample) and a
collate wrapper (times collation). Workers never write metric files.

The main process reads the block at most once a second, off the per-batch path, and
checks each registered pid with psutil (never waitpid: reaping belongs to torch).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import psutil
import torch
from torch.utils.data import Dataset, IterableDataset

log = logging.getLogger("instrument")

BUSY, SAMPLES, HEARTBEAT, PID = range(4)
_FIELDS = 4

# Set in a worker process by WorkerInit; None in the main process.
_row: np.ndarray | None = None


def new_block(num_workers: int) -> torch.Tensor:
    """A zeroed [num_workers, 4] int64 block in shared memory."""
    return torch.zeros((num_workers, _FIELDS), dtype=torch.int64).share_memory_()


class WorkerInit:
    """Chained worker_init_fn: binds this worker's row, then runs the user's function."""

    def __init__(self, block: torch.Tensor, user_fn: Callable[[int], Any] | None) -> None:
        self.block = block
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        global _row
        try:
            row = self.block.numpy()[worker_id]
            row[PID] = os.getpid()
            _row = row
        except Exception:  # metrics must never stop a worker
            _row = None
        if self.user_fn is not None:
            self.user_fn(worker_id)


def _account(start_ns: int, samples: int) -> None:
    row = _row
    if row is not None:
        end = time.perf_counter_ns()
        row[BUSY] += end - start_ns
        row[SAMPLES] += samples
        row[HEARTBEAT] = time.time_ns()


class TimedCollate:
    """Wraps collate_fn so that collation counts as worker busy time."""

    def __init__(self, collate_fn: Callable[[Any], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, data: Any) -> Any:
        if _row is None:
            return self.collate_fn(data)
        t0 = time.perf_counter_ns()
        out = self.collate_fn(data)
        _account(t0, 0)
        return out


class TimedMapDataset(Dataset):
    """A map-style dataset that times each sample inside worker processes.

    Reads and writes of other attributes go to the user's dataset, so a worker_init_fn
    that configures ``get_worker_info().dataset`` (shard bounds, say) works unchanged.
    """

    def __init__(self, dataset: Any) -> None:
        self.__dict__["dataset"] = dataset

    def __getitem__(self, index: Any) -> Any:
        t0 = time.perf_counter_ns()
        item = self.dataset[index]
        _account(t0, 1)
        return item

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        # torch's fetcher looks __getitems__ up on the instance; time it when it exists.
        if name == "__getitems__":
            inner = getattr(self.__dict__.get("dataset"), "__getitems__", None)
            if inner is None:
                raise AttributeError(name)
            return _TimedGetItems(inner)
        if name.startswith("__") or "dataset" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # A user's worker_init_fn configures get_worker_info().dataset: pass it through.
        setattr(self.dataset, name, value)


class _TimedGetItems:
    def __init__(self, inner: Callable[[Any], Any]) -> None:
        self.inner = inner

    def __call__(self, indices: Any) -> Any:
        t0 = time.perf_counter_ns()
        items = self.inner(indices)
        _account(t0, len(indices))
        return items


class TimedIterableDataset(IterableDataset):
    """An iterable dataset that times each sample inside worker processes."""

    def __init__(self, dataset: Any) -> None:
        self.__dict__["dataset"] = dataset

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.dataset)
        clock = time.perf_counter_ns
        while True:
            t0 = clock()
            try:
                item = next(it)
            except StopIteration:
                return
            _account(t0, 1)
            yield item

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "dataset" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # A user's worker_init_fn configures get_worker_info().dataset: pass it through.
        setattr(self.dataset, name, value)


def timed_dataset(dataset: Any) -> Any:
    """The wrapper that fits the dataset's kind (map-style or iterable)."""
    if isinstance(dataset, IterableDataset):
        return TimedIterableDataset(dataset)
    return TimedMapDataset(dataset)


class WorkerTracker:
    """Liveness and counters of one loader's worker processes, read off the hot path.

    Pids come from a source (the shared block, or a private iterator attribute for
    wrapped loaders). A registered pid found dead twice in a row, or dead when the
    loader raised, counts as lost; retire() forgets pids the loader shut down itself.
    """

    def __init__(self, min_interval: float = 1.0) -> None:
        self.min_interval = min_interval
        self.active = 0
        self.lost = 0
        self._lock = threading.Lock()
        self._blocks: list[torch.Tensor] = []
        self._pids: list[int] = []
        self._procs: dict[int, psutil.Process] = {}
        self._suspect: set[int] = set()
        self._next = 0.0

    # --- fed by the loader ------------------------------------------------------------
    def use_block(self, block: torch.Tensor) -> None:
        with self._lock:
            if not any(b is block for b in self._blocks):
                self._blocks.append(block)

    def set_pids(self, pids: list[int]) -> None:
        with self._lock:
            self._pids = [p for p in pids if p]

    def retire(self) -> None:
        """The loader shut its workers down itself: stop watching their pids."""
        with self._lock:
            for block in self._blocks:
                block[:, PID] = 0
            self._pids = []
            self._suspect.clear()
            self.active = 0
            self._next = 0.0

    # --- read by the collector ---------------------------------------------------------
    def refresh(self, now: float, on_error: bool = False) -> None:
        """Re-count live workers, at most once per min_interval unless on_error."""
        if not on_error and now < self._next:
            return
        with self._lock:
            self._next = now + self.min_interval
            pids = set(self._pids)
            for block in self._blocks:
                pids.update(int(p) for p in block.numpy()[:, PID] if p)
            alive = 0
            for pid in pids:
                if self._alive(pid):
                    alive += 1
                    self._suspect.discard(pid)
                elif on_error or pid in self._suspect:
                    self.lost += 1
                    self._forget(pid)
                else:
                    self._suspect.add(pid)
            self.active = alive

    def _alive(self, pid: int) -> bool:
        proc = self._procs.get(pid)
        try:
            if proc is None:
                proc = self._procs[pid] = psutil.Process(pid)
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def _forget(self, pid: int) -> None:
        self._suspect.discard(pid)
        self._procs.pop(pid, None)
        self._pids = [p for p in self._pids if p != pid]
        for block in self._blocks:
            col = block[:, PID]
            col[col == pid] = 0

    def per_worker(self) -> list[tuple[int, int, int, int]]:
        """(worker, busy_ns, samples, heartbeat_ns) summed over this loader's blocks."""
        with self._lock:
            if not self._blocks:
                return []
            width = max(b.shape[0] for b in self._blocks)
            total = np.zeros((width, _FIELDS), dtype=np.int64)
            for block in self._blocks:
                arr = block.numpy()
                total[: arr.shape[0], :2] += arr[:, :2]
                np.maximum(total[: arr.shape[0], 2], arr[:, 2], out=total[: arr.shape[0], 2])
            return [(i, int(r[BUSY]), int(r[SAMPLES]), int(r[HEARTBEAT])) for i, r in
                    enumerate(total)]
