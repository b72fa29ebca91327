"""A tuned loader's iterator: the per-batch TimedIterator (instrument/hotpath/
iterator.py) plus the tuner's readings in the loop, its way back when its first pool
fails, and its change mid-epoch. Only a loader the tuner works on gets one
(iter_start.timed_iterator); everything the tuner needs of the loop lives here, none of
it in the per-batch base.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import thread_time_ns
from typing import Any

from ..hotpath.batch import loader_len
from ..hotpath.iterator import Counter, FullBatches, TimedIterator
from ..instruments import Instruments, reraise_torch_worker_error

log = logging.getLogger("dataloader_exporter.instrument")

Retry = Callable[[Exception], "tuple[Any, Counter] | None"]
Resume = Callable[[], "tuple[Any, int, Counter] | None"]


class TunedIterator(TimedIterator):
    """TimedIterator of a tuned loader. _probe: the batch count at which its workers are
    read (0: never); _retry: the tuner's way back when its first worker pool fails its
    first batch; _resume: the tuner's change mid-epoch. While the tuner is at work
    (tuning_now) every batch is walked, so it is never given full batches to count
    unwalked (sized)."""

    __slots__ = ("_probe", "_resume", "_retry")

    def __init__(self, it: Any, owner: Instruments, start_ns: int, gen: int = 0,
                 count: Counter = loader_len, sized: FullBatches | None = None,
                 tuning_now: bool = True) -> None:
        super().__init__(it, owner, start_ns, gen, count, None if tuning_now else sized)
        self._probe = owner.probe_at(it) if tuning_now else 0
        self._retry: Retry | None = None
        self._resume: Resume | None = None

    def _first(self, batch: Any, t1: int) -> Any:
        self._retry = None  # the first batch came: the pool runs
        return TimedIterator._first(self, batch, t1)

    def _raised(self, e: Exception) -> Any:
        """next() raised e: the epoch goes on without the tuner's failed pool (its batch
        returned), or e goes on to the loop."""
        retry, self._retry = self._retry, None
        again = retry(e) if retry is not None and not self._last else None
        if again is None:
            return TimedIterator._raised(self, e)
        self._it, self._count = again  # the tuner's pool failed: the epoch without it
        self._gen = 0
        self._probe = 0
        return self.__next__()

    def _walk(self, batch: Any, b: int) -> Any:
        """The tuner's reading and mid-epoch change when due, then the batch's walk."""
        if b == self._probe:
            self._probe = self._owner.probed(self._probe)
            if self._resume is not None:
                self._resumed(self._resume)
        return TimedIterator._walk(self, batch, b)

    def _resumed(self, resume: Resume) -> None:
        """The tuner's pending mid-epoch change, if any: the iterator from here on."""
        try:
            got = resume()
        except Exception as e:
            reraise_torch_worker_error(e)
            log.warning("the tuner's mid-epoch change failed; the epoch goes on as it was",
                        exc_info=True)
            self._resume = None
            return
        if got is not None:
            self._it, self._gen, self._count = got
            self._probe = self._owner.probe_at(self._it) if self._owner.tuning_now else 0


class CpuTunedIterator(TunedIterator):
    """A tuned loader's iterator without workers: also the loop thread's CPU time in each
    fetch, which tells the tuner's model how much of a batch's making is CPU work."""

    __slots__ = ()

    def __next__(self) -> Any:
        c0 = thread_time_ns()
        try:
            return TunedIterator.__next__(self)
        finally:
            rec = self._rec
            rec.fetch_cpu_ns += thread_time_ns() - c0
            rec.fetch_cpu_n += 1
