"""The per-batch code of an instrumented loader: the iterator the training loop takes.

TimedIterator times each next() of torch's iterator (or of a loader held from outside)
with two clock readings and records the result as integers on the loader's recorder
(recorder.py): two ring appends and a few integer updates a batch, in C where built
(base.Timed), no lock, file or GPU synchronisation; a full batch of a loader whose
batches hold a fixed size is counted without walking it (TimedIterator._arm).
Everything that happens less often (the first batch, the end of an epoch, an error) goes
to the loader's Instruments; a tuned loader's iterator (instrument/tuner/iterator.py)
adds the tuner's readings. How the iterator is built, at iter(): instrument/iter_start.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, SupportsIndex

from ..instruments import Instruments, reraise_torch_worker_error
from .base import Timed
from .batch import batch_nbytes, loader_len

Counter = Callable[[Any], "int | None"]
# (batch size, full batches in an epoch) of a loader whose every batch but an epoch's last
# holds the batch size and whose sampler yields len(sampler) indices
# (iter_start.fixed_size).
FullBatches = tuple[int, int]

BYTES_EVERY = 256  # batches between two samples of a batch's bytes (each a walk, ~1 µs)

log = logging.getLogger("dataloader_exporter.instrument")


class TimedIterator(Timed):
    """Times each next() of the iterator it holds; everything else passes through. The
    per-batch part is Timed's (base.py); this class is what happens less often."""

    __slots__ = ("__weakref__", "_count", "_done", "_end", "_gen", "_owner", "_sized",
                 "_start")

    def __init__(self, it: Any, owner: Instruments, start_ns: int, gen: int = 0,
                 count: Counter = loader_len, sized: FullBatches | None = None) -> None:
        self._it = it  # the iterator timed (torch's, a held loader's, or the tuner's)
        self._rec = owner.rec
        self._last = 0  # perf_counter_ns of its last batch (0: none yet)
        # Full batches counted without a walk (_arm): while rec.batches < _mark, a batch
        # holds _size samples and nothing else is due; 0: every batch walks.
        self._mark = 0
        self._size = 0
        self._count = count  # how a batch's samples are counted
        self._sized = sized  # (size, full batches) until armed or found not to hold (_arm)
        self._end = 0  # the epoch's last full batch, in rec.batches (0: unknown)
        self._owner = owner  # the loader's Instruments
        self._start = start_ns  # perf_counter_ns of its iter()
        self._gen = gen  # its workers' generation (0: none)
        self._done = False  # whether its end was recorded

    def _exhausted(self) -> None:
        """next() raised StopIteration: the epoch's end, recorded once."""
        if self._done:
            return
        self._done = True
        try:
            self._owner.end(self._gen)
        except Exception as e:
            reraise_torch_worker_error(e)
            log.debug("metrics bookkeeping failed at the end of an epoch", exc_info=True)

    def _raised(self, e: Exception) -> Any:
        """next() raised e: it goes on to the loop (a loop may skip a bad batch and go
        on)."""
        self._mark = 0  # a batch lost to an error: the full batches' count is off
        self._sized = None
        self._failed(e)
        raise e

    def _first(self, batch: Any, t1: int) -> Any:
        rec = self._rec
        rec.first_at_ns = t1
        self._owner.first_batch(batch, t1 - self._start)
        self._last = rec.last_batch_ns = t1
        b = rec.batches = rec.batches + 1
        return self._walk(batch, b)

    def _walk(self, batch: Any, b: int) -> Any:
        """The batch's samples counted by its walk, its bytes sampled every BYTES_EVERY
        batches (rec.batches now b)."""
        rec = self._rec
        n = None
        try:  # free in CPython 3.11 unless it raises; an odd batch must not stop training
            n = self._count(batch)
            if n is None:
                rec.samples_known = False
            else:
                rec.samples += n
            if not b % BYTES_EVERY:
                rec.batch_bytes = batch_nbytes(batch)
        except Exception as e:
            reraise_torch_worker_error(e)
        if self._sized is not None:
            self._arm(b, n)
        return batch

    def _arm(self, b: int, n: int | None) -> None:
        """After a batch counted by its walk (n samples, rec.batches now b): the batches
        up to the epoch's last full one (_end, in rec.batches) are counted as size each,
        but at each BYTES_EVERY-th batch. Armed at the first batch, only when it holds
        the batch size (a tuner at work reads the loop: its iterator is never given
        _sized); a loader sharing the recorder only brings _end sooner, so the last,
        partial batch and everything after _end is always walked."""
        end = self._end
        if not end:
            if self._sized is None:
                return
            size, full = self._sized
            if n != size or full < 2:
                self._sized = None
                return
            end = self._end = b + full - 1
            self._size = size
        if b >= end:
            self._mark = 0
            self._sized = None
            return
        self._mark = min(end + 1, (b // BYTES_EVERY + 1) * BYTES_EVERY)

    def _failed(self, exc: BaseException) -> None:
        """next() raised exc: reported (Instruments.error), the loop sees it as it is."""
        try:
            self._owner.error(exc, self._it, count=not isinstance(self, QuietIterator))
        except Exception as e:
            reraise_torch_worker_error(e)
            log.debug("metrics bookkeeping failed at an error", exc_info=True)

    def __len__(self) -> int:
        return len(self._it)

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        """copy, deepcopy and pickle fail as they do for the iterator it times (torch's
        raise NotImplementedError); where that one could be copied, this one still cannot:
        a copy of its timing state would count the same batches twice."""
        self._it.__reduce_ex__(protocol)
        raise TypeError(f"cannot pickle {type(self).__name__!r} object")


class QuietIterator(TimedIterator):
    """A held torch loader's iterator: its batches are measured by the holder; this only
    ends its workers' generation and reports an error (TimedIterator._exhausted,
    _failed)."""

    __slots__ = ()

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            self._exhausted()
            raise
        except Exception as e:
            self._failed(e)
            raise
