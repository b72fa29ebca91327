"""Worker processes report to their main process through a small shared-memory block.

How the block reaches the workers, and why only this way. torch hands a worker four
objects of ours: the dataset, the sampler's indices, ``worker_init_fn`` and ``collate_fn``.
torch and users branch on the dataset's type (``IterDataPipe`` sharding and reseeding,
``IterableDataset``, ``isinstance(get_worker_info().dataset, MyDataset)``), so the dataset
is never replaced, not even for the workers, and ``worker_init_fn`` is left alone too.
What remains is ``collate_fn``, a plain callable that torch calls once per batch in the
worker and never inspects. While the iterator starts its workers it sees a
``TimedCollate`` around the user's function; ``loader.collate_fn`` is the user's again
before ``iter()`` returns.

At the end of each batch a worker writes into its row of an int64 block: the process's
CPU time so far, samples collated, the wall time (ns) and its pid. How long a worker
spent fetching samples (wall time, I/O included) cannot be known without wrapping the
dataset, so it is not measured: CPU time is what is exported. One block belongs to one
torch iterator (one generation of workers); when that iterator is collected its workers
are gone, and the block's figures are folded into per-worker totals and released.

The main process reads the blocks at most once a second, off the per-batch path, and
checks each pid with psutil (never waitpid: reaping belongs to torch).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil
import torch
from torch.utils.data import get_worker_info

log = logging.getLogger("instrument")

CPU, SAMPLES, HEARTBEAT, PID = range(4)
_FIELDS = 4


def new_block(num_workers: int) -> torch.Tensor:
    """A zeroed [num_workers, 4] int64 block in shared memory."""
    return torch.zeros((num_workers, _FIELDS), dtype=torch.int64).share_memory_()


class TimedCollate:
    """The user's collate_fn, plus one row update per batch when called in a worker."""

    def __init__(self, collate_fn: Callable[[Any], Any], block: torch.Tensor,
                 batched: bool) -> None:
        self.collate_fn = collate_fn
        self.block = block
        self.batched = batched  # auto-collation: `data` is a list of samples
        self._row: Any = None  # this process's row; False where there is none

    def __getstate__(self) -> dict[str, Any]:
        return {"collate_fn": self.collate_fn, "block": self.block, "batched": self.batched,
                "_row": None}

    def __call__(self, data: Any) -> Any:
        out = self.collate_fn(data)
        row = self._row
        if row is None:
            row = self._row = self._bind()
        if row is not False:
            # A __getitems__ may return something without len(): then no samples are added.
            row[SAMPLES] += (len(data) if hasattr(data, "__len__") else 0) if self.batched else 1
            row[CPU] = time.process_time_ns()
            row[HEARTBEAT] = time.time_ns()
        return out

    def _bind(self) -> Any:
        try:
            info = get_worker_info()
            if info is None:
                return False
            row = self.block.numpy()[info.id]
            row[PID] = os.getpid()
            return row
        except Exception:  # metrics must never stop a worker
            return False


class _Generation:
    """One torch iterator's workers: their block (None for wrapped loaders) and pids."""

    __slots__ = ("block", "pids", "watched")

    def __init__(self, block: torch.Tensor | None, pids: list[int]) -> None:
        self.block = block
        self.pids = pids
        self.watched = True

    def all_pids(self) -> set[int]:
        pids = set(self.pids)
        if self.block is not None:
            pids.update(int(p) for p in self.block.numpy()[:, PID] if p)
        return pids


class WorkerTracker:
    """Liveness and counters of one loader name's worker processes, read off the hot path.

    A watched pid found dead twice in a row, or dead when the loader raised, counts as
    lost. A generation stops being watched when its workers end on purpose (the end of
    a non-persistent epoch) and is folded into the totals when its iterator is collected.
    """

    def __init__(self, min_interval: float = 1.0) -> None:
        self.min_interval = min_interval
        self.active: int | None = 0
        self.lost = 0
        self._lock = threading.RLock()  # retire() may run from the GC inside a locked call
        self._live: dict[int, _Generation] = {}
        self._ids = 0
        self._cpu = np.zeros(0, dtype=np.int64)
        self._samples = np.zeros(0, dtype=np.int64)
        self._beat = np.zeros(0, dtype=np.int64)
        self._procs: dict[int, psutil.Process] = {}
        self._suspect: set[int] = set()
        self._next = 0.0

    # --- fed by the loader ------------------------------------------------------------
    def start(self, iterator: Any, block: torch.Tensor | None, pids: list[int]) -> int:
        """Watches a new iterator's workers until the iterator (weak-referenceable) is
        collected, after torch has shut them down."""
        with self._lock:
            self._ids += 1
            key = self._ids
            self._live[key] = _Generation(block, [p for p in pids if p])
            self._next = 0.0
        weakref.finalize(iterator, self.retire, key)
        return key

    def stop(self, key: int, retire: bool = False) -> None:
        """Its workers ended on purpose: stop watching them (and fold them, if asked)."""
        with self._lock:
            gen = self._live.get(key)
            if gen is not None:
                gen.watched = False
                self._drop_pids(gen)
        if retire:
            self.retire(key)

    def retire(self, key: int) -> None:
        """The iterator is gone, and its workers with it: fold their figures, free the block."""
        with self._lock:
            gen = self._live.pop(key, None)
            if gen is None:
                return
            self._drop_pids(gen)
            if gen.block is not None:
                arr = gen.block.numpy()
                n = arr.shape[0]
                self._grow(n)
                self._cpu[:n] += arr[:, CPU]
                self._samples[:n] += arr[:, SAMPLES]
                np.maximum(self._beat[:n], arr[:, HEARTBEAT], out=self._beat[:n])

    def _drop_pids(self, gen: _Generation) -> None:
        for pid in gen.all_pids():
            self._suspect.discard(pid)
            self._procs.pop(pid, None)

    def _grow(self, n: int) -> None:
        if self._cpu.shape[0] < n:
            grow = n - self._cpu.shape[0]
            self._cpu = np.concatenate([self._cpu, np.zeros(grow, dtype=np.int64)])
            self._samples = np.concatenate([self._samples, np.zeros(grow, dtype=np.int64)])
            self._beat = np.concatenate([self._beat, np.zeros(grow, dtype=np.int64)])

    # --- read by the collector ---------------------------------------------------------
    def refresh(self, now: float, on_error: bool = False) -> None:
        """Re-count live workers, at most once per min_interval unless on_error."""
        if not on_error and now < self._next:
            return
        with self._lock:
            self._next = now + self.min_interval
            watched = [g for g in self._live.values() if g.watched]
            pids: set[int] = set()
            for gen in watched:
                pids |= gen.all_pids()
            if watched and not pids:
                self.active = None  # workers exist, but none can be seen yet
                return
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
        for gen in self._live.values():
            gen.pids = [p for p in gen.pids if p != pid]
            if gen.block is not None:
                col = gen.block[:, PID]
                col[col == pid] = 0

    def per_worker(self) -> list[tuple[int, int, int, int]]:
        """(worker, cpu_ns, samples, heartbeat_ns) per worker index that has reported."""
        with self._lock:
            blocks = [g.block for g in self._live.values() if g.block is not None]
            width = max([self._cpu.shape[0], *(b.shape[0] for b in blocks)])
            if not width:
                return []
            cpu = np.zeros(width, dtype=np.int64)
            samples = np.zeros(width, dtype=np.int64)
            beat = np.zeros(width, dtype=np.int64)
            n = self._cpu.shape[0]
            cpu[:n] += self._cpu
            samples[:n] += self._samples
            beat[:n] = self._beat
            for block in blocks:
                arr = block.numpy()
                m = arr.shape[0]
                cpu[:m] += arr[:, CPU]
                samples[:m] += arr[:, SAMPLES]
                np.maximum(beat[:m], arr[:, HEARTBEAT], out=beat[:m])
            # A worker that has not finished a batch yet has no figures: none are made up.
            return [(i, int(cpu[i]), int(samples[i]), int(beat[i])) for i in range(width)
                    if beat[i]]
