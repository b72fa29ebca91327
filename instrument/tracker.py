"""Liveness and per-worker totals of one loader name's worker processes, off the hot path.

A generation is one torch iterator's workers: their shared-memory block (workers.py; None
for wrapped loaders) and their pids. It is watched while its workers should be alive,
and folded into per-worker totals, its block released, once torch's iterator is collected
(torch has shut the workers down by then). The finalizer only queues the generation: the
fold happens at the next locked call, so a garbage collection inside a locked call (a
scrape, say) cannot count a generation twice.

A watched worker that is gone counts as lost only when that is known: it was killed or
exited non-zero (read without reaping it: waitid with WNOWAIT, the check torch's own
SIGCHLD handler makes, or a zombie's /proc stat), or it is gone when the loader raised.
A worker that exits 0 has finished on purpose (an IterableDataset shard ran out, torch
shut it down).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from typing import Any

import numpy as np
import psutil
import torch

from .workers import CPU, HEARTBEAT, MISCOUNTED, PID, SAMPLES, UNCOUNTED

CLEAN, FAILED = "clean", "failed"


def exit_status(pid: int) -> str | None:
    """How a dead process ended, CLEAN or FAILED, without reaping it; None when unknown."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (ChildProcessError, OSError):
        info = None
    else:
        if info is None or info.si_pid == 0:
            return None  # still running
        return CLEAN if info.si_code == os.CLD_EXITED and info.si_status == 0 else FAILED
    try:  # not our child (forkserver): a zombie still shows its exit code (Linux >= 3.5)
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    if len(fields) < 50 or fields[0] != b"Z":
        return None
    return CLEAN if int(fields[49]) == 0 else FAILED


class _Totals:
    """Per-worker-index totals of folded generations: CPU and samples summed, the latest
    heartbeat, and the UNCOUNTED and MISCOUNTED flags summed (workers.py)."""

    __slots__ = ("beat", "cpu", "miscounted", "samples", "uncounted")

    def __init__(self, width: int = 0) -> None:
        self.cpu = np.zeros(width, dtype=np.int64)
        self.samples = np.zeros(width, dtype=np.int64)
        self.beat = np.zeros(width, dtype=np.int64)
        self.uncounted = np.zeros(width, dtype=np.int64)
        self.miscounted = np.zeros(width, dtype=np.int64)

    @property
    def width(self) -> int:
        return int(self.cpu.shape[0])

    def grow(self, width: int) -> None:
        if width > self.width:
            extra = np.zeros(width - self.width, dtype=np.int64)
            for name in self.__slots__:
                setattr(self, name, np.concatenate([getattr(self, name), extra]))

    def add(self, block: torch.Tensor) -> None:
        arr = block.numpy()
        n = arr.shape[0]
        self.grow(n)
        self.cpu[:n] += arr[:, CPU]
        self.samples[:n] += arr[:, SAMPLES]
        self.uncounted[:n] += arr[:, UNCOUNTED]
        self.miscounted[:n] += arr[:, MISCOUNTED]
        np.maximum(self.beat[:n], arr[:, HEARTBEAT], out=self.beat[:n])

    def copy(self) -> _Totals:
        out = _Totals()
        for name in self.__slots__:
            setattr(out, name, getattr(self, name).copy())
        return out


class _Generation:
    __slots__ = ("block", "pids", "watched")

    def __init__(self, block: torch.Tensor | None, pids: list[int]) -> None:
        self.block = block
        self.pids = set(pids)
        self.watched = True

    def all_pids(self) -> set[int]:
        pids = set(self.pids)
        if self.block is not None:
            pids.update(int(p) for p in self.block.numpy()[:, PID] if p)
        return pids


class WorkerTracker:
    """Live workers, lost workers and per-worker totals for one (loader, rank)."""

    def __init__(self, min_interval: float = 1.0) -> None:
        self.min_interval = min_interval
        self.active: int | None = None  # None: not known (yet)
        # True while the loader has workers this process cannot see: active is unknown.
        self.blind = False
        self.lost = 0
        self._lock = threading.Lock()
        self._live: dict[int, _Generation] = {}
        self._collected: deque[int] = deque()  # generations whose iterator is gone
        self._done: set[int] = set()  # pids that ended, lost or not: never counted again
        self._ids = 0
        self._totals = _Totals()
        self._procs: dict[int, psutil.Process] = {}
        self._next = 0.0

    # --- fed by the loader ------------------------------------------------------------
    def start(self, iterator: Any, block: torch.Tensor | None, pids: list[int]) -> int:
        """Watches a new (weak-referenceable) iterator's workers until it is collected."""
        with self._lock:
            self._fold_collected()
            self._ids += 1
            key = self._ids
            self._live[key] = _Generation(block, [p for p in pids if p])
            self._next = 0.0
        weakref.finalize(iterator, self._collected.append, key)  # no lock: see the docstring
        return key

    def stop(self, key: int) -> None:
        """Its workers ended on purpose (the end of a non-persistent epoch): stop watching."""
        with self._lock:
            self._fold_collected()
            gen = self._live.get(key)
            if gen is not None:
                gen.watched = False
                for pid in gen.all_pids():
                    self._procs.pop(pid, None)
            self._next = 0.0  # the next read counts again: these workers are gone now

    def _fold_collected(self) -> None:
        """Folds the generations whose iterator is gone into the totals (lock held)."""
        while self._collected:
            gen = self._live.pop(self._collected.popleft(), None)
            if gen is None:
                continue
            for pid in gen.all_pids():
                self._procs.pop(pid, None)
                self._done.discard(pid)
            if gen.block is not None:
                self._totals.add(gen.block)

    # --- read by the collector ---------------------------------------------------------
    def refresh(self, now: float, on_error: bool = False) -> None:
        """Re-counts live workers, at most once per min_interval unless on_error (the
        loader raised: a worker gone now was lost, whatever its exit)."""
        with self._lock:
            self._fold_collected()
            if not on_error and now < self._next:
                return
            self._next = now + self.min_interval
            watched = [g for g in self._live.values() if g.watched]
            if self.blind and not watched:
                self.active = None
                return
            known: set[int] = set().union(*(g.all_pids() for g in watched))
            if watched and not known:
                self.active = None  # workers exist, but none can be seen yet
                return
            alive = 0
            for pid in known - self._done:
                if self._alive(pid):
                    alive += 1
                    continue
                how = exit_status(pid)
                if how == FAILED or on_error:
                    self.lost += 1
                if how is not None or on_error:
                    self._done.add(pid)
                    self._procs.pop(pid, None)
            self.active = alive

    def _alive(self, pid: int) -> bool:
        proc = self._procs.get(pid)
        try:
            if proc is None:
                proc = self._procs[pid] = psutil.Process(pid)
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def _current(self) -> _Totals:
        """Folded totals plus the live generations' blocks (lock held)."""
        self._fold_collected()
        totals = self._totals.copy()
        for g in self._live.values():
            if g.block is not None:
                totals.add(g.block)
        return totals

    def per_worker(self) -> list[tuple[int, int, int | None, int]]:
        """(worker, cpu_ns, samples, heartbeat_ns) per worker index that has reported;
        samples None where some batch of that worker could not be counted."""
        with self._lock:
            t = self._current()
        # A worker that has not finished a batch yet has no figures: none are made up.
        return [(i, int(t.cpu[i]), None if t.uncounted[i] else int(t.samples[i]),
                 int(t.beat[i])) for i in range(t.width) if t.beat[i]]

    def miscounted(self) -> bool:
        """Whether a worker found the main process's sample count of a batch wrong."""
        with self._lock:
            return bool(self._current().miscounted.any())
