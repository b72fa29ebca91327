"""Liveness and per-worker totals of one loader name's worker processes, off the hot path.

A generation is one torch iterator's workers: their shared-memory block
(hotpath/workerblock.py; None for wrapped loaders) and their pids. It is watched while
its workers should be alive (from the first locked call after start(), which only queues
it), and folded into per-worker totals once torch's iterator is collected (torch has shut
the workers down by then); its block is then released, or kept for the name's next pool
(take_block). The finalizer only queues the generation: the fold
happens at the next locked call, so a garbage collection inside a locked call (a scrape,
say) cannot count a generation twice.

A watched worker that is gone counts as lost only when that is known: it was killed or
exited non-zero (read without reaping it: waitid with WNOWAIT, the check torch's own
SIGCHLD handler makes, or a zombie's /proc stat), or it is gone when the loader raised.
A worker that exits 0 has finished on purpose (an IterableDataset shard ran out, torch
shut it down). A worker that failed gets its cause when its exit says it
(failure_causes.py); one whose exit cannot be read is lost with no cause claimed.

Each refresh also reads /proc for every live worker (procstat.py): where its time goes,
its memory, and the memory its process may still allocate (process_memory_available).
"""

from __future__ import annotations

import itertools
import operator
import os
import signal
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy

from dataloader_exporter.core.catalogue import FAILURE_CAUSES
from dataloader_exporter.core.facts.cgroup import cgroup_memory_available
from dataloader_exporter.core.facts.memory import host_memory

from .failure_causes import (
    ALIVE,
    CRASH,
    GONE,
    Exit,
    Liveness,
    cause_of_exit,
    exit_of,
    is_torch_worker_error,
    oom_watch,
    shm_full,
    signal_name,
)
from .hotpath.layout import CPU, HEARTBEAT, MISCOUNTED, PID, SAMPLES, UNCOUNTED
from .hotpath.workerblock import Block, own_figures
from .procstat import Figures, LoopAccount, ProcAccount


def process_memory_available() -> int | None:
    """What this process's container (or the host) may still allocate; None when it cannot
    be read."""
    try:
        total, available = host_memory()
        return cgroup_memory_available(total, available)
    except Exception:  # a figure that cannot be read is left out, never guessed
        return None


class _Totals:
    """Per-worker-index totals of folded generations: CPU and samples summed, the latest
    heartbeat, and the UNCOUNTED and MISCOUNTED flags summed (hotpath/workerblock.py).
    Plain lists: a few workers' rows, folded at each short-lived pool's end."""

    __slots__ = ("beat", "cpu", "miscounted", "samples", "uncounted")

    def __init__(self) -> None:
        self.cpu: list[int] = []
        self.samples: list[int] = []
        self.beat: list[int] = []
        self.uncounted: list[int] = []
        self.miscounted: list[int] = []

    @property
    def width(self) -> int:
        return len(self.cpu)

    def add(self, rows: list[list[int]]) -> None:
        """A block's rows (block.tolist())."""
        extra = len(rows) - len(self.cpu)
        if extra > 0:
            for name in self.__slots__:
                getattr(self, name).extend([0] * extra)
        for i, row in enumerate(rows):
            self.cpu[i] += row[CPU]
            self.samples[i] += row[SAMPLES]
            self.uncounted[i] += row[UNCOUNTED]
            self.miscounted[i] += row[MISCOUNTED]
            self.beat[i] = max(self.beat[i], row[HEARTBEAT])

    def copy(self) -> _Totals:
        out = _Totals()
        for name in self.__slots__:
            setattr(out, name, list(getattr(self, name)))
        return out


_pid_of = operator.itemgetter(PID)  # a block row's pid (0: no worker wrote it)


class _Gone(weakref.ref):
    """A weak reference to a generation's iterator that names the generation (key)."""
    __slots__ = ("key",)
    key: int


class _Generation:
    __slots__ = ("block", "pids", "ref", "watched")

    def __init__(self, block: Block | None, pids: list[int]) -> None:
        self.block = block
        self.pids = set(pids)
        self.pids.discard(0)  # a worker torch has not started (no pid yet)
        self.watched = True
        self.ref: _Gone | None = None  # its iterator, queued on _collected when collected

    def all_pids(self, rows: list[list[int]] | None = None) -> set[int]:
        """The pids torch gave and those its workers wrote in the block (`rows`: the
        block's, when read already)."""
        pids = set(self.pids)
        if self.block is not None:
            pids.update(map(_pid_of, rows or self.block.tolist()))
            pids.discard(0)  # a row no worker wrote
        return pids


class WorkerTracker:
    """Live workers, lost workers and per-worker totals for one (loader, rank)."""

    def __init__(self, min_interval: float = 0.9) -> None:
        self.min_interval = min_interval
        self.active: int | None = None  # None: not known (yet)
        # True while the loader has workers this process cannot see: active is unknown.
        self.blind = False
        self.lost = 0
        self._lock = threading.Lock()
        self._live: dict[int, _Generation] = {}
        self._collected: deque[_Gone] = deque()  # generations whose iterator is gone
        # start()'s queue: (ref, block, pids, (the OOM-kill reading,)).
        self._pending: deque[tuple[_Gone, Block | None, list[int], Any]] = deque()
        self._keys = itertools.count(1)  # generation keys (_ids: the last one watched)
        self._done: set[int] = set()  # pids that ended, lost or not: never counted again
        self._ids = 0
        self._stops = 0
        self._totals = _Totals()
        self._liveness = Liveness()
        self._next = 0.0
        self.proc = ProcAccount()
        self.loop = LoopAccount()  # the loop thread's CPU, for a loader without workers
        self.failures = dict.fromkeys(FAILURE_CAUSES, 0)
        # Told of each failure with a cause: (cause, pid or None, what was seen).
        self.report: Callable[[str, int | None, str], None] | None = None
        self._unreported: list[tuple[str, int | None, str]] = []
        self._seen: dict[int, tuple[float, int] | None] = {}  # pid -> last alive reading
        self._batches_seen = 0  # the loader's batches at the last /proc reading
        self._prepared: tuple[tuple[float, int] | None] | None = None  # see prepare()
        # The last folded generation's block, its rows and every pid that shared it
        # (take_block).
        self._spare: tuple[numpy.ndarray[Any, Any], int, frozenset[int]] | None = None

    # --- fed by the loader ------------------------------------------------------------
    def prepare(self) -> None:
        """Before a new pool is forked: the generations gone folded and the OOM count
        read (or taken from a reading at most min_interval old, the time a worker seen
        alive at a refresh may go unread: a pool started every few milliseconds reads it
        once per interval), so that start() has little to do while the new workers share
        the process's memory (each page written then is copied)."""
        with self._lock:
            self._fold_collected()
            self._prepared = (oom_watch().read(self.min_interval),)

    def start(self, iterator: Any, block: Block | None, pids: list[int]) -> _Gone:
        """Watches a new iterator's workers until it is collected. Returns its weak
        reference, whose key names the generation; raises TypeError, having done nothing,
        for an iterator that cannot be weakly referenced. pids: those torch gave, read by
        the caller in the loop's thread (another thread's reference to torch's iterator
        could be its last, and shut its workers down there).

        Only queued here, watched from the next locked call on: this runs while the new
        workers share the process's pages (each page written is copied), and a short
        epoch's pool has ended before anyone reads it. The OOM-kill count is read before
        the workers could be killed (by prepare(), or now)."""
        ref = _Gone(iterator, self._collected.append)  # no lock: see the docstring
        ref.key = next(self._keys)
        prepared, self._prepared = self._prepared, None
        self._pending.append((ref, block, pids, prepared or (oom_watch().read(),)))
        return ref

    def _watch_pending(self) -> None:
        """Watches the generations start() queued (lock held)."""
        while self._pending:
            ref, block, pids, (reading,) = self._pending.popleft()
            gen = self._live[ref.key] = _Generation(block, pids)
            gen.ref = ref
            self._ids = ref.key
            self._next = 0.0
            self._seen.update(dict.fromkeys(gen.pids, reading))

    def stop(self, key: int) -> None:
        """Its workers ended on purpose (the end of a non-persistent epoch): stop watching.
        Told again (the next iter() while the old iterator is still held), it counts
        nothing more: its workers' own figures are counted once."""
        with self._lock:
            self._fold_collected()
            gen = self._live.get(key)
            self._stops += 1
            if gen is not None and gen.watched:
                rows = gen.block.tolist() if gen.block is not None else None
                if rows:  # a pool too short for two /proc readings
                    self.proc.unsampled(own_figures(rows))
                self._unwatch(gen, rows)
            self._next = 0.0  # the next read counts again: these workers are gone now

    def _unwatch(self, gen: _Generation, rows: list[list[int]] | None) -> None:
        """Nothing more is read of a generation's workers; rows: its block's, where read
        already (lock held)."""
        gen.watched = False
        gen.pids = gen.all_pids(rows)  # all of them: no worker starts after this
        for pid in gen.pids:
            self._liveness.forget(pid)
            self.proc.end(pid)
            self._seen.pop(pid, None)

    def _fold_collected(self) -> None:
        """Watches the generations queued by start(), and folds those whose iterator is
        gone into the totals (lock held)."""
        if self._pending:
            self._watch_pending()
        while self._collected:
            gen = self._live.pop(self._collected.popleft().key, None)
            if gen is None:
                continue
            self._next = 0.0  # its workers are gone: the next read counts again
            rows = gen.block.tolist() if gen.block is not None else None
            if gen.watched:  # else stop() has unwatched all its pids
                self._unwatch(gen, rows)
            self._done.difference_update(gen.pids)
            if rows is not None:
                self._totals.add(rows)
                self._keep(gen, rows)

    def _keep(self, gen: _Generation, rows: list[list[int]]) -> None:
        """Keeps a folded generation's block (`rows`: its rows, read) for take_block where
        it is an anonymous mapping (workers forked, not torch's shared memory) that
        nothing else holds (lock held). Unmapping one just after its workers exit costs
        about 0.1 ms: short-lived loaders of a name built one after another take 0.2 ms
        less an epoch with it kept (two runs of 600 paired rounds, 2 workers)."""
        block = gen.block
        # A numpy block is an anonymous mapping (new_block); gen's slot, `block` and
        # getrefcount's argument: no one else's.
        if type(block) is numpy.ndarray and sys.getrefcount(block) <= 3:
            self._spare = (block, len(rows), frozenset(gen.pids))

    def take_block(self, num_workers: int) -> numpy.ndarray[Any, Any] | None:
        """For a new pool of forked workers: the block of the name's last folded pool,
        zeroed, where it has num_workers rows and no process that shared it exists any
        more (a worker torch could only terminate may still write); else None. A block
        not taken is released."""
        with self._lock:
            self._fold_collected()
            spare, self._spare = self._spare, None
        if spare is None:
            return None
        block, rows, pids = spare
        if rows != num_workers or any(map(_exists, pids)):
            return None
        block.fill(0)
        return block

    # --- read by the collector ---------------------------------------------------------
    def refresh(self, now: float, on_error: bool = False,
                exits: Callable[[int], Exit | None] | None = None, batches: int = 0,
                named: dict[int, int | None] | None = None, force: bool = False) -> None:
        """Re-counts live workers and reads their /proc figures, at most once per
        min_interval unless on_error (the loader raised: a worker gone now with no exit
        to read was lost). exits: how a dead worker ended, where torch has reaped it;
        batches: the loader's count so far (the workers' time counts while it grows);
        named: the workers torch's exception says died (pid -> signal, None for "exited
        unexpectedly"), lost whatever their exit code. force: read now, whatever the
        interval (the tuner's samples at an epoch's first batch and end)."""
        with self._lock:
            if force:
                self._next = 0.0
            self._refresh(now, on_error, exits, batches, named or {})
            for pid, signo in (named or {}).items():  # workers we could not see
                if pid not in self._done:
                    self.lost += 1
                    self._died(pid, (signo, None) if signo is not None else (None, 0), True)
                    self._end(pid)
        self._deliver()

    def _refresh(self, now: float, on_error: bool,
                 exits: Callable[[int], Exit | None] | None, batches: int,
                 named: dict[int, int | None]) -> None:
        """refresh(), the lock held."""
        self._fold_collected()
        if not on_error and now < self._next:
            return
        self._next = now + self.min_interval
        if not on_error:
            self.loop.observe(batches != self._batches_seen and not self._live and not self.blind)
        watched = [g for g in self._live.values() if g.watched]
        if self.blind and not watched:
            self.active = None
            return
        known: set[int] = set().union(*(g.all_pids() for g in watched))
        if watched and not known:
            self.active = None  # workers exist, but none can be seen yet
            return
        alive: list[int] = []
        pids = sorted(known - self._done)
        reading = oom_watch().read() if pids else None  # a file read: only for workers
        for pid in pids:
            state = self._liveness.state(pid)
            if state != GONE:  # alive, or on its way out: not ended yet
                alive.append(pid)
                if state == ALIVE:  # a kill count read beside a dying worker is not
                    self._seen[pid] = reading  # one seen before its kill
                continue
            how = exit_of(pid) or (exits(pid) if exits is not None else None)
            if how is None and named.get(pid) is not None:  # reaped: torch's word for it
                how = (named[pid], None)
            if how is not None and (how != (None, 0) or pid in named):
                self.lost += 1
                self._died(pid, how, unexpected=pid in named)
            elif how is None and on_error:  # gone when the loader raised: lost, cause unknown
                self.lost += 1
            if how is not None or on_error:
                self._end(pid)
        if not on_error:
            self.proc.observe(alive, now, active=batches != self._batches_seen,
                              room=process_memory_available)
            self._batches_seen = batches
        self.active = len(alive)

    def _end(self, pid: int) -> None:
        """A worker is done with, lost or not: never counted again (lock held)."""
        self._done.add(pid)
        self._liveness.forget(pid)
        self._seen.pop(pid, None)
        self.proc.end(pid)

    def _died(self, pid: int, how: Exit, unexpected: bool = False) -> None:
        """A worker that ended badly: its cause, from its exit (lock held); unexpected:
        torch says it exited unexpectedly, whatever its exit code."""
        signo, code = how
        oom = oom_watch().claim(self._seen.get(pid)) if signo == signal.SIGKILL else False
        cause = cause_of_exit(signo, code, oom, signo == signal.SIGBUS and shm_full())
        if cause is None and unexpected:
            cause = CRASH
        if cause is None:
            return  # a SIGKILL the OOM-kill count cannot tell about: no cause claimed
        seen = f"exit code {code}" if signo is None else f"signal {signal_name(signo)}"
        if oom:
            seen += "; the kernel's OOM-kill count rose"
        self.failures[cause] += 1
        self._unreported.append((cause, pid, seen))

    def fail(self, cause: str, pid: int | None = None, seen: str = "") -> None:
        """Counts one failure and tells `report` of it (lock not held)."""
        with self._lock:
            self.failures[cause] += 1
            self._unreported.append((cause, pid, seen))
        self._deliver()

    def _deliver(self) -> None:
        """Tells `report` of the failures counted since (outside the lock: it reads us)."""
        with self._lock:
            pending, self._unreported = self._unreported, []
        for failure in pending:
            if self.report is not None:
                try:
                    self.report(*failure)
                except Exception as e:  # a report must never break bookkeeping...
                    if is_torch_worker_error(e):
                        raise  # ...nor swallow torch's word that a worker died

    def version(self) -> tuple[int, ...]:
        """Changes when a generation of workers starts, stops or is collected, a worker
        finishes a batch (its heartbeat), a worker is lost or a failure counted; not with
        liveness or memory, which change without any of these."""
        with self._lock:
            if self._pending:
                self._watch_pending()
            beats = sum(int(g.block[:, HEARTBEAT].sum()) for g in self._live.values()
                        if g.block is not None)
            return (self._ids, self._stops, len(self._collected), beats, self.lost,
                    *self.failures.values())

    def proc_figures(self) -> Figures | None:
        """The workers' /proc figures (procstat.Figures); None where unknown."""
        with self._lock:
            return self.proc.figures()

    def grown(self, pid: int) -> tuple[int, int] | None:
        """A worker that ended lately: its first and last private memory read, if read."""
        with self._lock:
            return self.proc.growth.ended.get(pid)

    def _current(self) -> _Totals:
        """Folded totals plus the live generations' blocks (lock held)."""
        self._fold_collected()
        totals = self._totals.copy()
        for g in self._live.values():
            if g.block is not None:
                totals.add(g.block.tolist())
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
            self._fold_collected()
            return any(self._totals.miscounted) or any(
                bool(g.block[:, MISCOUNTED].any()) for g in self._live.values()
                if g.block is not None)


def _exists(pid: int) -> bool:
    """Whether a process of this pid exists, a zombie (not reaped yet) or another
    user's included."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True
