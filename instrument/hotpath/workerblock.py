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
CPU time so far, samples collated, the wall time (ns), its pid, its thread's run-queue
wait (one pread of a schedstat file it keeps open), the first batch's CPU, wait and wall
time, and two flags that keep sample counts honest (batch.py): UNCOUNTED,
batches whose samples it could not count (batch_size=None items that are not
recognisably batches), and MISCOUNTED, batches
of a custom collate_fn whose count as the main process reads it (batch_len) differs from
the samples the collate_fn was given. The main process exports no sample count that one
of them makes unknown. How long a worker spent fetching samples (wall time, I/O
included) cannot be known without wrapping the dataset, so it is not measured: CPU time
is what is exported. One block belongs to one torch iterator (one generation of
workers); when that iterator is collected its workers are gone, and the block's figures
are folded into per-worker totals and released.

The main process reads the blocks at most once a second, off the per-batch path
(instrument/worker_tracker.py).
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import time
from collections.abc import Callable
from typing import Any, Union

import numpy
import torch
from torch.utils.data import get_worker_info

from .base import NATIVE
from .batch import batch_len, item_len
from .layout import (
    CPU,
    FD_UNOPENED,
    FIRST_BEAT,
    FIRST_CPU,
    FIRST_WAIT,
    HEARTBEAT,
    MISCOUNTED,
    PID,
    ROW_BYTES,
    ROW_FIELDS,
    SAMPLES,
    SCHEDSTAT,
    UNCOUNTED,
    WAIT,
)


def start_method(loader: Any) -> str | None:
    """How the loader's workers start: its multiprocessing context's method, else the
    process's (as set, or the platform's default: the first of get_all_start_methods(),
    asked for without fixing it)."""
    context = getattr(loader, "multiprocessing_context", None)
    if context is not None:
        return str(context.get_start_method())
    method = multiprocessing.get_start_method(allow_none=True)
    return method or multiprocessing.get_all_start_methods()[0]


# A worker block: for forked workers a numpy array over an anonymous shared mapping, which
# the main process reads and zeroes without torch's dispatch; for spawned workers torch's
# shared memory, which torch pickles to them.
Block = Union[torch.Tensor, "numpy.ndarray[Any, Any]"]


def new_block(num_workers: int, forked: bool = False) -> Block:
    """A zeroed [num_workers, len(ROW_FIELDS)] int64 block in shared memory. forked: the
    workers are forked from this process, which is all they need to share it: an anonymous
    shared mapping (no /dev/shm file, no descriptor, a third of torch's cost to make) held
    by a numpy array, unmapped when the array is freed. Otherwise a tensor in torch's
    shared memory, which a spawned worker's unpickling maps."""
    shape = (num_workers, len(ROW_FIELDS))
    if not forked:
        return torch.zeros(shape, dtype=torch.int64).share_memory_()
    return numpy.frombuffer(mmap.mmap(-1, num_workers * ROW_BYTES), dtype=numpy.int64
                            ).reshape(shape)


def own_figures(rows: list[list[int]]) -> list[tuple[int, int, int, int]]:
    """Each worker's own figures from its first batch to its last, from a block's rows
    (block.tolist()): (pid, CPU ns, run-queue wait ns or -1 where unreadable, wall ns),
    for workers that finished a batch."""
    out = []
    for row in rows:
        if row[FIRST_BEAT] and row[PID]:
            wait = -1 if min(row[WAIT], row[FIRST_WAIT]) < 0 else row[WAIT] - row[FIRST_WAIT]
            out.append((row[PID], row[CPU] - row[FIRST_CPU], wait,
                        row[HEARTBEAT] - row[FIRST_BEAT]))
    return out


def _wait_ns(fd: int) -> int:
    """This thread's run-queue wait so far (schedstat's 2nd field), -1 if unreadable."""
    try:
        return int(os.pread(fd, 128, 0).split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def py_beat(row: Any, samples: int, miscounted: bool, fd: int) -> int:
    """A worker's row (a numpy view) at the end of a batch; returns the schedstat fd.

    samples: the batch's count, or -1 when unknown (UNCOUNTED + 1); miscounted:
    MISCOUNTED + 1. The pid is written at the first batch, and schedstat opened when fd
    is FD_UNOPENED (-1 from then on where it cannot be). Then the process's CPU time,
    the wall time and the run-queue wait (-1 where unreadable); at the first batch, these
    three also as FIRST_*. _hotpath.beat does the same on the row's address.
    """
    if samples < 0:
        row[UNCOUNTED] += 1
    else:
        row[SAMPLES] += samples
    if miscounted:
        row[MISCOUNTED] += 1
    if not row[PID]:
        row[PID] = os.getpid()
    if fd == FD_UNOPENED:
        try:  # kept open for the worker's life: one pread a batch
            fd = os.open(SCHEDSTAT, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            fd = -1
    row[CPU] = time.process_time_ns()
    row[HEARTBEAT] = time.time_ns()
    row[WAIT] = _wait_ns(fd) if fd >= 0 else -1
    if not row[FIRST_BEAT]:
        row[FIRST_CPU], row[FIRST_WAIT], row[FIRST_BEAT] = row[CPU], row[WAIT], row[HEARTBEAT]
    return fd


if NATIVE:
    from ._hotpath import address as buffer_address
    from ._hotpath import beat
else:
    beat = py_beat  # unused: TimedCollate.native is False


def address(block: Block) -> int:
    """Where a block's first row is, for the C build's beat."""
    if isinstance(block, torch.Tensor):
        return block.data_ptr()
    return buffer_address(block)  # numpy's own ways build Python objects (ctypes, a dict)


class TimedCollate:
    """The user's collate_fn, plus one row update per batch when called in a worker.

    batched: auto-collation (`data` is the list of samples of one batch); else `data` is
    one item as the dataset yielded it (batch_size=None). verify: check batch_len of the
    output against len(data) (a custom collate_fn). block None: in the main process
    (num_workers=0), where a miscount only calls on_miscount.
    """

    def __init__(self, collate_fn: Callable[[Any], Any], block: Block | None,
                 batched: bool, verify: bool = False,
                 on_miscount: Callable[[], None] | None = None) -> None:
        self.collate_fn = collate_fn
        self.block = block
        self.batched = batched
        self.verify = verify
        self.on_miscount = on_miscount
        # The C build writes a row by its address: the block's, read here before the
        # workers fork (a spawned worker reads its own copy's).
        self.native = NATIVE
        self._base = address(block) if block is not None and NATIVE else 0
        self._row: Any = None  # this worker's row (address or numpy view); False: none
        self._fd = FD_UNOPENED  # this worker thread's schedstat, opened at its first batch

    def __getstate__(self) -> dict[str, Any]:
        return {"collate_fn": self.collate_fn, "block": self.block, "batched": self.batched,
                "verify": self.verify, "on_miscount": None, "_base": 0, "_row": None,
                "_fd": FD_UNOPENED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.native = NATIVE  # the build of the process that unpickles it (a spawned worker)

    def __call__(self, data: Any) -> Any:
        out = self.collate_fn(data)
        row = self._row
        if row is None:
            row = self._row = self._bind()
        try:  # counting must never stop a worker or change its batch
            if self.batched:
                # A __getitems__ may return something without len(): its count is unknown.
                n: int | None = len(data) if hasattr(data, "__len__") else None
                miscounted = self.verify and n is not None and batch_len(out) != n
            else:
                n, miscounted = item_len(out), False
        except Exception:
            n, miscounted = None, False
        if row is False:
            if miscounted and self.on_miscount is not None:
                self.on_miscount()
            return out
        try:
            self._fd = (beat if self.native else py_beat)(
                row, -1 if n is None else n, miscounted, self._fd)
        except Exception:  # metrics must never stop a worker
            self._row = False
        return out

    def _bind(self) -> Any:
        """This worker's row: its address (C build) or a numpy view; False where there is
        none (the main process, or a block that does not fit)."""
        if self.block is None:
            return False
        try:
            info = get_worker_info()
            if info is None or not 0 <= info.id < self.block.shape[0]:
                return False
            block = self.block
            if self.native:
                return (self._base or address(block)) + info.id * ROW_BYTES
            return (block.numpy() if isinstance(block, torch.Tensor) else block)[info.id]
        except Exception:  # metrics must never stop a worker
            return False
