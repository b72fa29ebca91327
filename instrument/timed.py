"""The timed iterator, and iter() of an instrumented loader: through its own __iter__, its
new workers given their one hook (workers.py) while they start."""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

import torch
from torch.utils.data import default_collate

from dataloader_exporter.core.settings import log_name

from . import compat
from .batch import batch_len, batch_nbytes, collated_len, item_len, loader_len
from .instruments import Instruments, reraise_torch_worker_error
from .originals import TORCH_ITER, lazy
from .tuning import fresh_seed
from .workers import TimedCollate, new_block

Counter = Callable[[Any], "int | None"]

log = logging.getLogger("dataloader_exporter.instrument")

BYTES_EVERY = 64  # batches between two samples of the batch size in bytes


def counter_for(loader: Any) -> Counter:
    """How a torch loader's batches are counted (batch.py): by the shape default_collate
    gives them, by the length their fields agree on (a custom collate_fn, checked against
    the samples it was given), or, with batch_size=None, only on evidence of a batch."""
    if getattr(loader, "batch_sampler", None) is None:
        return item_len
    return collated_len if getattr(loader, "collate_fn", None) is default_collate else batch_len


class _Plan:
    """What instrumented_iter hands torch's iterator: a collate_fn for its new workers (or
    to check a custom collate_fn's counts in the main process), and their block."""

    def __init__(self, loader: Any, dle: Instruments, quiet: bool, again: bool = False
                 ) -> None:
        dle.start_epoch(loader, again)
        self.count = counter_for(loader)
        workers = getattr(loader, "num_workers", 0) or 0
        verify = self.count is batch_len and not quiet
        self.block: torch.Tensor | None = None
        self.collate: TimedCollate | None = None
        current = compat.persistent_iterator(loader)
        self.started = dle.started if dle.started and dle.started[0]() is current else None
        self.reused = bool(workers) and (self.started is not None or (
            bool(getattr(loader, "persistent_workers", False)) and dle.tracking(current)))
        if not workers:
            if verify:  # the main process checks a custom collate_fn's count itself
                self.collate = TimedCollate(loader.collate_fn, None, True, True,
                                            dle.rec.miscount)
        elif not self.reused:  # new workers: their one hook (workers.py)
            self.block = new_block(workers)
            self.collate = TimedCollate(loader.collate_fn, self.block,
                                        loader.batch_sampler is not None, verify)
        self.workers = workers


def instrumented_iter(loader: Any, dle: Instruments, torch_iter: Callable[[Any], Any],
                      quiet: bool = False) -> Any:
    """iter(loader) through its own __iter__ (`torch_iter`: torch's, or a subclass's),
    timed, its new workers given a TimedCollate while they start (their one hook, see
    workers.py); the loader's collate_fn is the user's again before this returns.

    quiet: a holder (webdataset's WebLoader) measures the batches the loop takes; this
    iterator only reports the workers and the end of its epochs. A loader this cannot
    plan for (a subclass without torch's attributes) is iterated as it is, unmeasured.
    A subclass's __iter__ that returns a generator has not run torch's yet: it is
    returned as it is, and measured where torch's runs (zerocode.py).
    """
    start = perf_counter_ns()
    seed = None if quiet else dle.at_iter(loader)
    undo = dle.tuning.undo if dle.tuning is not None else None
    torch_iter_as_is = torch_iter
    if seed is not None:  # the tuner shut the persistent pool down: a new one, same order
        torch_iter = fresh_seed(torch_iter, seed)
    try:
        plan = _Plan(loader, dle, quiet)
    except Exception:
        log.warning("dataloader %r: cannot instrument %s; it runs unmeasured",
                    log_name(dle.name), type(loader).__qualname__, exc_info=True)
        return torch_iter(loader)
    try:
        it = _start(loader, plan, torch_iter)
    except Exception as e:  # the tuner's first pool could not start: without it
        if undo is None or dle.tuning is None or not dle.tuning.cannot_run(loader, undo, e):
            raise
        plan, it = _again(loader, dle, torch_iter, quiet)
        undo = None
    if torch_iter_as_is is not TORCH_ITER and inspect.isgenerator(it):
        lazy(torch_iter_as_is)
        return it
    if plan.started is not None and plan.started[0]() is it:  # workers prestart() hooked
        dle.started = None
        plan.block = plan.started[1]
    gen = dle.track(it, plan.block) if plan.workers else 0
    if quiet:
        return QuietIterator(it, dle, start, gen, plan.count)
    timed = TimedIterator(it, dle, start, gen, plan.count)
    if undo is not None:  # its first batch may fail in the workers: the same epoch without
        timed._retry = _retry(loader, dle, undo, torch_iter)
    if dle.tuning is not None and dle.tuning.resumable and not dle.tuning.tuner.stable:
        timed._resume = _resumer(loader, dle, torch_iter)
    return timed


def _start(loader: Any, plan: _Plan, torch_iter: Callable[[Any], Any]) -> Any:
    return _with_collate(loader, plan.collate, torch_iter) if plan.collate else torch_iter(
        loader)


def _again(loader: Any, dle: Instruments, torch_iter: Callable[[Any], Any],
           quiet: bool = False) -> tuple[_Plan, Any]:
    """The same iter() planned and started anew, under the setting the tuner made or
    undid: its plan and torch's iterator."""
    plan = _Plan(loader, dle, quiet, again=True)
    return plan, _start(loader, plan, torch_iter)


def _retry(loader: Any, dle: Instruments, undo: Any, torch_iter: Callable[[Any], Any]
           ) -> Callable[[Exception], tuple[Any, Counter] | None]:
    """For the first batch of the tuner's first worker pool: when it fails, the same
    epoch again without workers (the loader's RNGs as before its iter(), so the same
    order), or None to let the error go on."""
    def retry(error: Exception) -> tuple[Any, Counter] | None:
        if dle.tuning is None or not dle.tuning.cannot_run(loader, undo, error):
            return None
        dle.forget_workers()  # ended on purpose: the failed pool goes with its iterator
        plan, it = _again(loader, dle, torch_iter)
        return it, plan.count
    return retry


def _resumer(loader: Any, dle: Instruments, torch_iter: Callable[[Any], Any]
             ) -> Callable[[], tuple[Any, int, Counter] | None]:
    """For a tuned loader that resumes exactly from its state_dict(): at the loop's
    readings, the tuner's pending mid-epoch change made (tuning.resume) and the iterator
    that goes on from the same batch under it, with its workers' hook and tracking."""
    def resume() -> tuple[Any, int, Counter] | None:
        tuning = dle.tuning
        if tuning is None or tuning.pending is None or not tuning.resume(loader):
            return None
        dle.forget_workers()  # the old pool ends with its iterator, on purpose
        plan, it = _again(loader, dle, torch_iter)
        gen = dle.track(it, plan.block) if plan.workers else 0
        tuning.remark(loader)
        return it, gen, plan.count
    return resume


def prestart(loader: Any, dle: Instruments, state_dict: Callable[[Any], Any]) -> Any:
    """loader.state_dict() asked before the first iter(): torchdata starts the iterator
    and its workers there, so they get their hook here, and iter() takes them over."""
    workers = getattr(loader, "num_workers", 0) or 0
    if not workers or compat.persistent_iterator(loader) is not None:
        return state_dict(loader)
    try:
        block = new_block(workers)
        collate = TimedCollate(loader.collate_fn, block, loader.batch_sampler is not None,
                               counter_for(loader) is batch_len)
    except Exception:
        return state_dict(loader)
    result = _with_collate(loader, collate, state_dict)
    it = compat.persistent_iterator(loader)
    if it is not None:
        with contextlib.suppress(TypeError):
            dle.started = (weakref.ref(it), block)
    return result


def _with_collate(loader: Any, collate: TimedCollate, torch_iter: Callable[[Any], Any]) -> Any:
    """torch_iter(loader) while its collate_fn is `collate` (the user's again after)."""
    user = loader.collate_fn
    loader.collate_fn = collate
    try:
        return torch_iter(loader)
    finally:
        loader.collate_fn = user


class TimedIterator:
    """Times each next() of the iterator it holds; everything else passes through."""

    __slots__ = ("__weakref__", "_count", "_done", "_gen", "_it", "_last", "_owner", "_probe",
                 "_rec", "_resume", "_retry", "_start")

    def __init__(self, it: Any, owner: Instruments, start_ns: int, gen: int = 0,
                 count: Counter = loader_len) -> None:
        self._it = it
        self._count = count
        self._owner = owner
        self._rec = owner.rec
        self._start = start_ns
        self._gen = gen
        self._last = 0
        self._done = False
        # The batch count at which a tuned loader's workers are sampled (0: never).
        self._probe = owner.probe_at(it) if owner.tuning_now else 0
        # The tuner's way back when its first worker pool fails its first batch.
        self._retry: Callable[[Exception], tuple[Any, Counter] | None] | None = None
        # The tuner's mid-epoch change of a loader that resumes from its state_dict().
        self._resume: Callable[[], tuple[Any, int, Counter] | None] | None = None

    def __iter__(self) -> TimedIterator:
        return self

    def __next__(self) -> Any:
        t0 = perf_counter_ns()
        try:
            batch = next(self._it)
        except StopIteration:
            self._finish(True)
            raise
        except Exception as e:
            retry, self._retry = self._retry, None
            again = retry(e) if retry is not None and not self._last else None
            if again is not None:  # the tuner's pool failed: the epoch without it
                self._it, self._count = again
                self._gen = 0
                self._probe = 0
                return self.__next__()
            self._finish(False, e)  # not the end: a loop may skip a bad batch and go on
            raise
        t1 = perf_counter_ns()
        rec = self._rec
        rec.fetch.append(t1 - t0)
        if self._last:
            rec.step.append(t0 - self._last)
        else:
            self._retry = None
            self._owner.first_batch(batch, t1 - self._start)
        self._last = t1
        rec.last_batch_ns = t1
        rec.batches += 1
        if rec.batches == self._probe:
            self._probe = self._owner.probed(self._probe)
            if self._resume is not None:
                self._resumed(self._resume)
        try:  # free in CPython 3.11 unless it raises; an odd batch must not stop training
            n = self._count(batch)
            if n is None:
                rec.samples_known = False
            else:
                rec.samples += n
            if not rec.batches % BYTES_EVERY:
                rec.batch_bytes = batch_nbytes(batch)
        except Exception as e:
            reraise_torch_worker_error(e)
        return batch

    def _resumed(self, resume: Callable[[], tuple[Any, int, Counter] | None]) -> None:
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

    def _finish(self, clean: bool, exc: BaseException | None = None) -> None:
        if clean and self._done:
            return
        self._done = self._done or clean
        try:
            if clean:
                self._owner.end(self._gen)
            elif exc is not None:
                self._owner.error(exc, self._it, count=not isinstance(self, QuietIterator))
        except Exception as e:
            reraise_torch_worker_error(e)
            log.debug("metrics bookkeeping failed at the end of an epoch", exc_info=True)

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in TimedIterator.__slots__:
            raise AttributeError(name)
        return getattr(self._it, name)


class QuietIterator(TimedIterator):
    """A held torch loader's iterator: its batches are measured by the holder; this only
    ends its workers' generation and reports an error (see TimedIterator._finish)."""

    __slots__ = ()

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            self._finish(True)
            raise
        except Exception as e:
            self._finish(False, e)
            raise
