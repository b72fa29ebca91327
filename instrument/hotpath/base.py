"""The per-batch path's base types: in C (_hotpath.c) where the extension was built, else
the same in Python here (and with DATALOADER_EXPORTER_PURE_PYTHON=1 set at import).

- Ring(maxlen): a bounded queue of int nanoseconds. The loop appends; a reader takes all
  of it, oldest first, as int64 values (take(), a buffer for numpy.frombuffer). At maxlen
  the oldest value goes, as in a deque with maxlen.
- Counts: the base of recorder.LoaderRecorder: the counters the loop bumps (batches,
  samples, last_batch_ns: perf_counter_ns of the last batch handed out) and its two
  rings, fetch and step, which the subclass sets before a Timed records into it.
- Timed: the base of iterator.TimedIterator. Its __next__ reads the clock, calls next()
  on _it, reads the clock again, and records a full batch in _rec: the fetch wait (the
  two readings apart), the step (since its last batch's reading, _last), batches + 1,
  samples + _size while rec.batches stays under _mark. Everything else is a call of the
  subclass: _first(batch, t1) for its first batch, _walk(batch, b) at batch count b from
  _mark on, _exhausted() at the end (the same end follows: the iterator's StopIteration,
  if any), _raised(exc) for an Exception (its return is the batch, what it raises goes
  on); any other BaseException passes untouched. _exhausted and _raised run as in an
  `except` block: the error is the one being handled. An iterator that loops back to its
  Timed is a RecursionError, as in Python. It holds those five fields only (the subclass
  declares its own) and passes any other attribute, but for names that start with "__",
  through to _it.

The C build does a full batch in about 60 ns and no Python frame; this module in about
300 ns (docs/design/hotpath.md says what that buys). Both read perf_counter_ns's clock
(CLOCK_MONOTONIC). Each call holds the interpreter lock: a reader's take() and the
loop's append never interleave.
"""

from __future__ import annotations

import logging
from collections import deque
from itertools import repeat, starmap
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

import numpy as np

from dataloader_exporter.core.envnames import ENV_PURE_PYTHON, pure_python_asked

PURE_PYTHON_ENV = ENV_PURE_PYTHON
DRAIN_SLICE = 8192  # values taken in one call from C (the Python Ring): ~0.3 ms


class PyRing(deque[int]):
    """Ring in Python: a deque with maxlen, taken one popleft at a time from C."""

    def __init__(self, maxlen: int) -> None:
        if maxlen < 1:
            raise ValueError("maxlen must be at least 1")
        super().__init__((), maxlen)

    def take(self) -> np.ndarray:
        """The values appended so far, oldest first (the first len() of them: the loop's
        thread may append meanwhile), in slices of DRAIN_SLICE, between which a loop
        waiting for the interpreter lock gets it."""
        n = len(self)
        parts = [np.empty(0, np.int64)]
        while n > 0:
            k = min(n, DRAIN_SLICE)
            parts.append(np.fromiter(starmap(self.popleft, repeat((), k)), np.int64, k))
            n -= k
        return parts[-1] if len(parts) <= 2 else np.concatenate(parts, dtype=np.int64)


class PyCounts:
    """Counts in Python."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    batches = 0
    samples = 0
    last_batch_ns = 0
    fetch: PyRing  # set by the subclass
    step: PyRing


class PyTimed:
    """Timed in Python."""

    __slots__ = ("_it", "_last", "_mark", "_rec", "_size")
    _it: Any
    _rec: Any
    _last: int
    _mark: int
    _size: int

    def __iter__(self) -> Any:
        return self

    def __next__(self) -> Any:
        t0 = perf_counter_ns()
        try:
            batch = next(self._it)
        except StopIteration:
            self._exhausted()
            raise
        except Exception as e:
            return self._raised(e)
        t1 = perf_counter_ns()
        rec = self._rec
        rec.fetch.append(t1 - t0)
        last = self._last
        if not last:
            return self._first(batch, t1)
        rec.step.append(t0 - last)
        self._last = rec.last_batch_ns = t1
        b = rec.batches = rec.batches + 1
        if b < self._mark:
            rec.samples += self._size
            return batch
        return self._walk(batch, b)

    def _first(self, batch: Any, t1: int) -> Any:
        raise NotImplementedError

    def _walk(self, batch: Any, b: int) -> Any:
        raise NotImplementedError

    def _exhausted(self) -> None:
        raise NotImplementedError

    def _raised(self, e: Exception) -> Any:
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in PyTimed.__slots__:
            raise AttributeError(name)
        return getattr(self._it, name)


NATIVE = False
_FORCED = pure_python_asked()
if TYPE_CHECKING:
    from ._hotpath import Counts, Ring, Timed
else:
    if not _FORCED:
        try:
            from ._hotpath import Counts, Ring, Timed

            NATIVE = True
        except ImportError:  # not built (no compiler at install): the same in Python
            pass
    if not NATIVE:
        Ring, Counts, Timed = PyRing, PyCounts, PyTimed
        logging.getLogger("dataloader_exporter.instrument").info(
            "the loader's per-batch path runs in Python (%s), about 0.25 µs a batch more than "
            "its C build", f"{PURE_PYTHON_ENV} is set" if _FORCED
            else "instrument/hotpath/_hotpath.c was not built at install")


def drain(q: Any) -> np.ndarray:
    """Everything in a Ring, oldest first, as int64; the ring is left empty."""
    return np.frombuffer(q.take(), np.int64)
