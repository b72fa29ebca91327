"""iter() of an instrumented loader: through the loader's own __iter__, its new workers
given their one hook (hotpath/workerblock.py) while they start, and the TimedIterator
(hotpath/iterator.py) the loop then takes. Runs once per iter(), never per batch.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import operator
import threading
import warnings
import weakref
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    Subset,
    SubsetRandomSampler,
    default_collate,
)

from dataloader_exporter.core.settings import log_name

from . import compat
from .hotpath.batch import batch_len, collated_len, item_len
from .hotpath.iterator import Counter, FullBatches, QuietIterator, TimedIterator
from .hotpath.workerblock import Block, TimedCollate, new_block, start_method
from .instruments import Instruments
from .preflight import process_shm_size
from .torch_originals import TORCH_ITER, lazy

log = logging.getLogger("dataloader_exporter.instrument")


def counter_for(loader: Any) -> Counter:
    """How a torch loader's batches are counted (hotpath/batch.py): by the shape
    default_collate gives them, by the length their fields agree on (a custom collate_fn,
    checked against the samples it was given), or, with batch_size=None, only on evidence
    of a batch."""
    if getattr(loader, "batch_sampler", None) is None:
        return item_len
    return collated_len if getattr(loader, "collate_fn", None) is default_collate else batch_len


# torch's samplers whose len() is the number of indices they yield in an epoch.
EXACT_SAMPLERS = (SequentialSampler, RandomSampler, SubsetRandomSampler, DistributedSampler)


def fixed_size(loader: Any) -> FullBatches | None:
    """(batch size, full batches in an epoch: len(sampler) // batch size, 0 where len()
    fails) when every batch of an epoch but its last holds exactly the batch size, in
    order, and the sampler yields len(sampler) indices: torch's BatchSampler over one of
    EXACT_SAMPLERS, a dataset fetched one sample per index (no __getitems__ of its own,
    or a Subset of such), and with workers, in_order. Else None: each batch is walked
    (TimedIterator._arm). Read at iter(), before any worker forks."""
    batches = getattr(loader, "batch_sampler", None)
    if type(batches) is not BatchSampler:
        return None
    size, sampler = batches.batch_size, batches.sampler
    if type(size) is not int or size < 1 or type(sampler) not in EXACT_SAMPLERS:
        return None
    if getattr(loader, "num_workers", 0) and getattr(loader, "in_order", True) is not True:
        return None
    dataset = getattr(loader, "dataset", None)
    if type(dataset) is Subset:
        dataset = dataset.dataset
    if getattr(dataset, "__getitems__", None) is not None:
        return None
    return full_batches(size, sampler)


def full_batches(size: int, sampler: Any) -> FullBatches:
    """(size, len(sampler) // size, or 0 where len() fails): fixed_size's, of this epoch."""
    try:
        return size, len(sampler) // size
    except Exception:
        return size, 0


class _Plan:
    """What instrumented_iter hands torch's iterator: a collate_fn for its new workers (or
    to check a custom collate_fn's counts in the main process), and their block."""

    def __init__(self, loader: Any, instruments: Instruments, quiet: bool,
                 again: bool = False) -> None:
        instruments.start_epoch(loader, again)
        self.count = counter_for(loader)
        workers = getattr(loader, "num_workers", 0) or 0
        verify = self.count is batch_len and not quiet
        self.block: Block | None = None
        self.collate: TimedCollate | None = None
        started = instruments.started
        persistent = bool(getattr(loader, "persistent_workers", False))
        # The iterator a pool started earlier (prestart) or a persistent one lives in.
        current = compat.persistent_iterator(loader) if started or persistent else None
        self.started = started if started and started[0]() is current else None
        self.reused = bool(workers) and (self.started is not None or (
            persistent and instruments.tracking(current)))
        if not workers:
            if verify:  # the main process checks a custom collate_fn's count itself
                self.collate = TimedCollate(loader.collate_fn, None, True, True,
                                            instruments.rec.miscount)
        elif not self.reused:  # new workers: their one hook (hotpath/workerblock.py)
            instruments.before_pool(loader)
            forked = start_method(loader) == "fork"
            block = instruments.rec.workers.take_block(workers) if forked else None
            self.block = block if block is not None else new_block(workers, forked)
            self.collate = TimedCollate(loader.collate_fn, self.block,
                                        loader.batch_sampler is not None, verify)
        self.workers = workers


# Loader classes whose settings are plain instance attributes: torch's DataLoader (and
# instrument.DataLoader, added where it is defined). Only theirs take the kept plan below.
PLAIN_LOADERS: set[type] = {torch.utils.data.DataLoader}


# What a loader's plan without workers is made of, beside what torch's DataLoader does not
# let change after __init__ (dataset, sampler, batch_size, persistent_workers): its
# attributes of these names, and its batch sampler's batch_size and sampler.
SETTINGS = ("num_workers", "prefetch_factor", "pin_memory", "collate_fn", "in_order",
            "batch_sampler")
# Read as getattr() does (one call for all), never through loader.__dict__: once asked
# for, an instance's __dict__ slows every later attribute read of it in CPython 3.11
# (torch's own iter() of the loader by about 6,000 instructions).
_settings_of = operator.attrgetter(*SETTINGS)


class _Kept:
    """A plan without workers kept from the last iter() (Instruments.kept): while the
    loader's SETTINGS are of equal values, its batch sampler's size and sampler the same,
    and the /dev/shm size the same, an iter() takes it as it is (_kept_iter)."""

    __slots__ = ("batches", "count", "labels", "sampler", "shm", "size", "sized", "values")

    def __init__(self, values: tuple[Any, ...], count: Counter, sized: FullBatches | None,
                 labels: dict[str, str], shm: str) -> None:
        self.values, self.count, self.sized, self.labels, self.shm = (
            values, count, sized, labels, shm)
        self.batches = values[-1]
        self.size = self.batches.batch_size if self.batches is not None else None
        self.sampler = self.batches.sampler if self.batches is not None else None

    @classmethod
    def of(cls, loader: Any, count: Counter, sized: FullBatches | None,
           labels: dict[str, str], shm: str) -> _Kept | None:
        """The loader's plan kept, or None where it lacks one of SETTINGS or its batch
        sampler is neither torch's BatchSampler nor None."""
        try:
            values = _settings_of(loader)
        except AttributeError:
            return None
        batches = values[-1]
        if batches is not None and type(batches) is not BatchSampler:
            return None
        return cls(values, count, sized, labels, shm)


def _same_settings(loader: Any, values: tuple[Any, ...]) -> bool:
    """Whether the loader's SETTINGS still hold these values (_settings_of)."""
    try:
        return bool(_settings_of(loader) == values)
    except AttributeError:
        return False


def _kept_iter(loader: Any, instruments: Instruments, kept: _Kept, start: int) -> Any:
    """iter() of a plain loader without workers or tuner by its kept plan, or None where
    the plan no longer holds: what instrumented_iter would do with it, less the planning."""
    b = kept.batches
    if not (_same_settings(loader, kept.values)
            and (b is None or (b.batch_size == kept.size and b.sampler is kept.sampler))
            and kept.shm == process_shm_size()):
        return None
    instruments.rec.workers.loop.tid = threading.get_native_id()
    instruments.mark_epoch(kept.labels, True)
    sized = kept.sized and full_batches(kept.sized[0], kept.sampler)  # this epoch's length
    return TimedIterator(TORCH_ITER(loader), instruments, start, 0, kept.count, sized)


def timed_iterator(it: Any, instruments: Instruments, start: int, gen: int, count: Counter,
                   sized: FullBatches | None = None, cpu: bool = False) -> TimedIterator:
    """The iterator the loop takes from torch's (or a held loader's) `it`: a
    TimedIterator, or for a loader the tuner works on its TunedIterator (loaded on first
    use; cpu: one that also reads the loop thread's CPU time in each fetch, for a pool
    without workers)."""
    tuning = instruments.tuning
    if tuning is None:
        return TimedIterator(it, instruments, start, gen, count, sized)
    from .tuner.iterator import CpuTunedIterator, TunedIterator

    tuning_now = not tuning.tuner.stable  # instruments.tuning_now
    kind = CpuTunedIterator if cpu and tuning_now else TunedIterator
    return kind(it, instruments, start, gen, count, sized, tuning_now)


def instrumented_iter(loader: Any, instruments: Instruments, torch_iter: Callable[[Any], Any],
                      quiet: bool = False) -> Any:
    """iter(loader) through its own __iter__ (`torch_iter`: torch's, or a subclass's),
    timed, its new workers given a TimedCollate while they start (their one hook, see
    hotpath/workerblock.py); the loader's collate_fn is the user's again before this
    returns.

    quiet: a holder (webdataset's WebLoader) measures the batches the loop takes; this
    iterator only reports the workers and the end of its epochs. A loader this cannot
    plan for (a subclass without torch's attributes) is iterated as it is, unmeasured.
    A subclass's __iter__ that returns a generator has not run torch's yet: it is
    returned as it is, and measured where torch's runs (zerocode/hooks.py).
    """
    start = perf_counter_ns()
    kept = instruments.kept
    if (kept is not None and torch_iter is TORCH_ITER and not quiet
            and instruments.tuning is None and type(loader) in PLAIN_LOADERS):
        timed = _kept_iter(loader, instruments, kept, start)
        if timed is not None:
            return timed
    instruments.kept = None
    wrap = None if quiet else instruments.at_iter(loader)
    undo = instruments.tuning.undo if instruments.tuning is not None else None
    torch_iter_as_is = torch_iter
    if wrap is not None:  # the tuner rebuilt or kept a pool: its seeds, for the same batches
        torch_iter = wrap(torch_iter)
    try:
        plan = _Plan(loader, instruments, quiet)
    except Exception:
        log.warning("dataloader %r: cannot instrument %s; it runs unmeasured",
                    log_name(instruments.name), type(loader).__qualname__, exc_info=True)
        return torch_iter(loader)
    tuning = instruments.tuning
    tuning_now = tuning is not None and not tuning.tuner.stable  # instruments.tuning_now
    # Read before the workers fork: each page written after it is copied while they run.
    sized = _sized(loader, plan, torch_iter_as_is is TORCH_ITER and undo is None
                   and not tuning_now and not quiet)
    # So is an untuned loader's iterator, which gets torch's and the workers' generation
    # once they exist.
    ready = (TimedIterator(None, instruments, start, 0, plan.count, sized)
             if tuning is None and not quiet else None)
    try:
        it = _start(loader, plan, torch_iter, tuning is not None and not tuning.advice_only
                    and plan.workers != tuning.tuner.start.workers)
    except Exception as e:  # the tuner's first pool could not start: without it
        if undo is None or tuning is None or not tuning.cannot_run(loader, undo, e):
            raise
        plan, it = _again(loader, instruments, torch_iter, quiet)
        undo = None
        tuning_now = not tuning.tuner.stable
        sized = _sized(loader, plan, torch_iter_as_is is TORCH_ITER and not tuning_now
                       and not quiet)
    if torch_iter_as_is is not TORCH_ITER and inspect.isgenerator(it):
        lazy(torch_iter_as_is)
        return it
    if plan.started is not None and plan.started[0]() is it:  # workers prestart() hooked
        instruments.started = None
        plan.block = plan.started[1]
    gen = instruments.track(it, plan.block) if plan.workers else 0
    if quiet:
        return QuietIterator(it, instruments, start, gen, plan.count)
    if ready is not None:
        timed = ready
        timed._it, timed._gen = it, gen
    else:
        timed = timed_iterator(it, instruments, start, gen, plan.count, sized,
                               not plan.workers)
    if (not plan.workers and plan.collate is None and tuning is None and wrap is None
            and torch_iter_as_is is TORCH_ITER and type(loader) in PLAIN_LOADERS
            and instruments._made is not None):
        _, _, shm, labels = instruments._made
        instruments.kept = _Kept.of(loader, plan.count, sized, labels, shm)
    if tuning is None:
        return timed
    from .tuner.iterator import TunedIterator

    assert isinstance(timed, TunedIterator)
    if undo is not None:  # its first batch may fail in the workers: the same epoch without
        timed._retry = _retry(loader, instruments, undo, torch_iter)
    if tuning_now:
        if tuning.resumable:
            timed._resume = _resumer(loader, instruments, torch_iter)
        elif tuning.midepoch:
            from .tuner.switch import switcher

            timed._resume = switcher(loader, instruments, timed, torch_iter,
                                     functools.partial(_again, loader, instruments))
    return timed


def _sized(loader: Any, plan: _Plan, plain: bool) -> FullBatches | None:
    """fixed_size(loader) where its batches are counted by their shape (collated_len) and
    `plain`: torch's own iter(), no tuner at work or to undo, not quiet; else None."""
    return fixed_size(loader) if plain and plan.count is collated_len else None


def _start(loader: Any, plan: _Plan, torch_iter: Callable[[Any], Any],
           tuned: bool = False) -> Any:
    """torch's iter(); tuned: the tuner chose the worker count from what it measured, so
    torch's warning that it exceeds the CPU count (normal for blocked workers) is not
    repeated at each epoch."""
    if not tuned:
        return _with_collate(loader, plan.collate, torch_iter) if plan.collate else \
            torch_iter(loader)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create",
                                category=UserWarning)
        return _with_collate(loader, plan.collate, torch_iter) if plan.collate else \
            torch_iter(loader)


def _again(loader: Any, instruments: Instruments, torch_iter: Callable[[Any], Any],
           quiet: bool = False) -> tuple[_Plan, Any]:
    """The same iter() planned and started anew, under the setting the tuner made or
    undid: its plan and torch's iterator."""
    plan = _Plan(loader, instruments, quiet, again=True)
    return plan, _start(loader, plan, torch_iter, True)


def _retry(loader: Any, instruments: Instruments, undo: Any, torch_iter: Callable[[Any], Any]
           ) -> Callable[[Exception], tuple[Any, Counter] | None]:
    """For the first batch of the tuner's first worker pool: when it fails, the same
    epoch again without workers (the loader's RNGs as before its iter(), so the same
    order), or None to let the error go on."""
    def retry(error: Exception) -> tuple[Any, Counter] | None:
        if instruments.tuning is None or not instruments.tuning.cannot_run(loader, undo, error):
            return None
        instruments.forget_workers()  # ended on purpose: the failed pool goes with its iterator
        plan, it = _again(loader, instruments, torch_iter)
        return it, plan.count
    return retry


def _resumer(loader: Any, instruments: Instruments, torch_iter: Callable[[Any], Any]
             ) -> Callable[[], tuple[Any, int, Counter] | None]:
    """For a tuned loader that resumes exactly from its state_dict(): at the loop's
    readings, the tuner's pending mid-epoch change made (LoaderTuning.resume) and the iterator
    that goes on from the same batch under it, with its workers' hook and tracking."""
    def resume() -> tuple[Any, int, Counter] | None:
        tuning = instruments.tuning
        if tuning is None or tuning.pending is None or not tuning.resume(loader):
            return None
        instruments.forget_workers()  # the old pool ends with its iterator, on purpose
        plan, it = _again(loader, instruments, torch_iter)
        gen = instruments.track(it, plan.block) if plan.workers else 0
        tuning.remark(loader)
        return it, gen, plan.count
    return resume


def prestart(loader: Any, instruments: Instruments, state_dict: Callable[[Any], Any]) -> Any:
    """loader.state_dict() asked before the first iter(): torchdata starts the iterator
    and its workers there, so they get their hook here, and iter() takes them over."""
    workers = getattr(loader, "num_workers", 0) or 0
    if not workers or compat.persistent_iterator(loader) is not None:
        return state_dict(loader)
    try:
        block = new_block(workers, start_method(loader) == "fork")
        collate = TimedCollate(loader.collate_fn, block, loader.batch_sampler is not None,
                               counter_for(loader) is batch_len)
    except Exception:
        return state_dict(loader)
    result = _with_collate(loader, collate, state_dict)
    it = compat.persistent_iterator(loader)
    if it is not None:
        with contextlib.suppress(TypeError):
            instruments.started = (weakref.ref(it), block)
    return result


def _with_collate(loader: Any, collate: TimedCollate, torch_iter: Callable[[Any], Any]) -> Any:
    """torch_iter(loader) while its collate_fn is `collate` (the user's again after)."""
    user = loader.collate_fn
    # torch's own DataLoader.__setattr__ sets collate_fn as object's does, through a Python
    # frame (the second of them runs after the workers fork); a subclass's runs.
    put = object.__setattr__ if type(loader) in PLAIN_LOADERS else setattr
    put(loader, "collate_fn", collate)
    try:
        return torch_iter(loader)
    finally:
        put(loader, "collate_fn", user)
