"""The instrumented DataLoader, wrap() for loaders built elsewhere, and the timed iterator.

The training loop sees exactly what it would see without us: the same batches in the
same order, the same len() and the same exceptions, and torch sees the user's own
dataset, sampler and worker_init_fn (see workers.py for the one hook, collate_fn, that
the workers get wrapped). The per-batch cost is two perf_counter_ns calls, two deque
appends and a few integer updates.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import os
import weakref
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any, TypeVar

import torch
import torch.utils.data
from torch.utils.data import default_collate

from dataloader_exporter.core.env import ENV_DIR
from dataloader_exporter.core.facts.shm import SHM_PATH, shm_space
from dataloader_exporter.core.settings import log_name

from . import compat, envsettings, failures, zerocode
from .batch import batch_len, batch_nbytes, collated_len, item_len, loader_len, move
from .env import current_rank, local_world_size
from .gpu import gpu_uuid
from .hub import Hub, hub_for
from .preflight import LoaderConfig, Preflight
from .recorder import LoaderRecorder
from .tracker import from_exitcode
from .workers import TimedCollate, new_block

T_co = TypeVar("T_co", covariant=True)
Counter = Callable[[Any], "int | None"]

log = logging.getLogger("dataloader_exporter.instrument")

BYTES_EVERY = 64  # batches between two samples of the batch size in bytes
MAX_PENDING_EVENTS = 4096  # CUDA event pairs kept waiting before the oldest are dropped
WAIT_WRITE = 1.0  # seconds the loop's exception waits for the snapshot of a dead worker


class _Instruments:
    """One loader object's link to its recorder, sinks and advice.

    explicit: built by instrument.DataLoader or wrap() (not by zero-code mode), so a loader
    that is never iterated is worth a word (see zerocode.py).
    """

    def __init__(self, name: str, registry: Any, metrics_dir: str | None,
                 port: int | None, explicit: bool = True) -> None:
        self.name = name
        self.registry = registry
        self.metrics_dir = metrics_dir
        self.port = port
        self.explicit = explicit
        self.loader_class: type | None = None  # the class of the loader adopted (zerocode)
        self.iterated = False
        self.gpu_checked = False  # to_device onto CUDA has looked up the GPU's UUID
        self.hub: Hub = hub_for(registry)
        self.preflight = Preflight(name)
        self.config = LoaderConfig(None, None, None, None, None)
        self.epochs = 0
        self._rec: LoaderRecorder | None = None
        self._last_it: weakref.ref[Any] | None = None  # the iterator whose workers we track
        self._last_gen = 0
        self._said_failures: set[str] = set()
        self._urgent_once: set[str] = set()  # causes whose first failure was waited for
        # Workers a loader started outside __iter__ (prestart): their iterator and block.
        self.started: tuple[weakref.ref[Any], torch.Tensor] | None = None
        directory = metrics_dir or os.environ.get(ENV_DIR) or None
        if directory:
            self.hub.write_snapshots(directory)
        if port is not None:
            try:
                self.hub.serve(port)
            except OSError as e:
                log.warning("dataloader %r: cannot serve metrics on port %s: %s "
                            "(training goes on)", log_name(name), port, e)

    @property
    def rec(self) -> LoaderRecorder:
        if self._rec is None:
            self._rec = self.hub.recorder(self.name, current_rank())
        return self._rec

    def failed(self, cause: str, pid: int | None, seen: str) -> None:
        """One line per failure cause with what to change (failures.fix)."""
        if cause in self._said_failures:
            return
        self._said_failures.add(cause)
        rec = self.rec
        fig = rec.workers.proc_figures()
        live = rec.workers.active or 0
        rss = fig.rss_bytes // live if fig is not None and live else None
        who = f" (worker pid {pid})" if pid else ""
        text = failures.fix(cause, seen, self.config, max(rec.batch_bytes, 0),
                            local_world_size(), shm_space(SHM_PATH), rss)
        log.warning("dataloader %r%s: %s", log_name(self.name), who, text)

    def start_epoch(self, loader: Any) -> None:
        """At iter(): the loader's settings. The epoch itself starts at its first batch (a
        framework may call iter() to probe a loader and fetch nothing)."""
        self.config = LoaderConfig.of(loader)
        rec = self.rec
        rec.workers.report = self.failed  # failures are said with this loader's settings
        shm = shm_space(SHM_PATH)  # the trainer's own, which a doctor elsewhere cannot see
        rec.config = {"loader": self.name, "rank": rec.rank, **self.config.labels(),
                      "dev_shm_bytes": str(shm.size) if shm else ""}
        if self.config.num_workers == 0:
            rec.workers.blind = False
            if rec.workers.active is None:
                rec.workers.active = 0

    def tracking(self, it: Any) -> bool:
        """Whether `it` is the iterator whose workers are tracked already (persistent)."""
        last = self._last_it() if self._last_it is not None else None
        return last is not None and last is it

    def track(self, it: Any, block: torch.Tensor | None) -> int:
        """Tracks the workers of a new iterator until it is collected; 0 when there are none."""
        if self.tracking(it):
            return self._last_gen
        workers = self.rec.workers
        if self._last_gen and not self.config.persistent_workers:
            workers.stop(self._last_gen)  # a new epoch: torch shuts the old ones down on purpose
            self._last_gen = 0
        pids = compat.worker_pids(it)
        if block is None and not pids:
            # Workers we cannot see (a loader that is not torch's) are unknown, not 0.
            workers.blind = self.config.num_workers != 0
            return 0
        workers.blind = False
        try:
            self._last_it = weakref.ref(it)
        except TypeError:  # cannot tell when it goes away, so its workers are not tracked
            self._last_it = None
            return 0
        self._last_gen = self.rec.workers.start(it, block, pids)
        return self._last_gen

    def first_batch(self, batch: Any, since_iter_ns: int) -> None:
        rec = self.rec
        rec.first.append(since_iter_ns)
        self.iterated = True
        self.epochs += 1
        rec.epochs += 1
        try:
            self.preflight.on_iter(self.config, self.epochs)
        except Exception:  # advice must never stop training
            log.debug("preflight failed", exc_info=True)
        try:
            rec.batch_bytes = batch_nbytes(batch)
            self.preflight.on_first_batch(self.config, rec.batch_bytes)
        except Exception as e:
            reraise_torch_worker_error(e)
            log.debug("first-batch preflight failed", exc_info=True)

    def end(self, gen: int) -> None:
        """The iterator is exhausted (StopIteration)."""
        if gen and not self.config.persistent_workers:
            self.rec.workers.stop(gen)  # torch has shut these workers down on purpose
        self.hub.flush_now()

    def error(self, exc: BaseException, it: Any, count: bool = True) -> None:
        """The iterator `it` raised `exc` (the loop may catch it and go on): a worker gone
        now is lost, the failure is counted by its cause, and the snapshot is written
        (by the writer's thread, waited for up to WAIT_WRITE) before the exception goes on
        to the loop: for every worker's death and /dev/shm failure, and for the first
        error of the dataset (one that raises again and again costs nothing more). count
        False: a holder's inner loader, whose holder counts the exception."""
        self.iterated = True  # it was: a failed first batch is no framework's rebuild
        workers = self.rec.workers
        death = failures.deaths_in(exc)
        workers.refresh(0.0, on_error=True, named=dict.fromkeys(*death) if death else None,
                        exits=lambda pid: from_exitcode(compat.worker_exitcode(it, pid)))
        if not count:
            return
        cause = None if death else failures.cause_of_error(exc, self.config.num_workers or 0)
        if cause is not None:
            workers.fail(cause, None, failures.first_line(exc))
        if death or cause == failures.SHM or (cause is not None and
                                               cause not in self._urgent_once):
            if cause is not None:  # a dataset raising again and again waits once
                self._urgent_once.add(cause)
            self.hub.write_soon(wait=WAIT_WRITE)

    def note_gpu(self, uuid: str) -> None:
        """Labels dataloader_info with the GPU this loader's batches go to."""
        self.rec.gpu_uuid = uuid

    def to_device(self, batch: Any, device: Any, non_blocking: bool) -> Any:
        rec = self.rec
        dev = torch.device(device)
        if dev.type == "cuda":
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            if not self.gpu_checked:  # once: which GPU this rank feeds, for dataloader_info
                self.gpu_checked = True
                self.note_gpu(gpu_uuid(dev))
            self.preflight.on_cuda_transfer(self.config)
            stream = torch.cuda.current_stream(dev)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            out, nbytes = move(batch, dev, non_blocking)
            end.record(stream)
            if len(rec.pending_events) >= MAX_PENDING_EVENTS:
                rec.pending_events.popleft()
            rec.pending_events.append((start, end))
        else:
            t0 = perf_counter_ns()
            out, nbytes = move(batch, dev, non_blocking)
            rec.transfer.append(perf_counter_ns() - t0)
        rec.transfer_bytes += nbytes
        return out


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

    def __init__(self, loader: Any, dle: _Instruments, quiet: bool) -> None:
        dle.start_epoch(loader)
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


def instrumented_iter(loader: Any, dle: _Instruments, torch_iter: Callable[[Any], Any],
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
    try:
        plan = _Plan(loader, dle, quiet)
    except Exception:
        log.warning("dataloader %r: cannot instrument %s; it runs unmeasured",
                    log_name(dle.name), type(loader).__qualname__, exc_info=True)
        return torch_iter(loader)
    it = _with_collate(loader, plan.collate, torch_iter) if plan.collate else torch_iter(loader)
    if torch_iter is not zerocode.TORCH_ITER and inspect.isgenerator(it):
        zerocode.lazy(torch_iter)
        return it
    if plan.started is not None and plan.started[0]() is it:  # workers prestart() hooked
        dle.started = None
        plan.block = plan.started[1]
    gen = dle.track(it, plan.block) if plan.workers else 0
    cls = QuietIterator if quiet else TimedIterator
    return cls(it, dle, start, gen, plan.count)


def prestart(loader: Any, dle: _Instruments, state_dict: Callable[[Any], Any]) -> Any:
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


def holder_iter(holder: Any, inner: list[Any], dle: _Instruments,
                iterate: Callable[[Any], Any]) -> TimedIterator:
    """iter() of a holder (webdataset's WebLoader) that iterates the torch loaders
    `inner`: its batches timed and counted as the loop takes them; the torch loaders'
    iterations report their workers only (zerocode.hold)."""
    start = perf_counter_ns()
    zerocode.hold(inner, dle)
    dle.start_epoch(inner[0])
    rechunked = len(getattr(holder, "pipeline", ())) > len(inner)
    count = loader_len if rechunked else counter_for(inner[0])
    return TimedIterator(iterate(holder), dle, start, 0, count)


def reraise_torch_worker_error(e: Exception) -> None:
    """A dead worker's error torch raised in our bookkeeping goes on to the loop."""
    if failures.is_torch_worker_error(e):
        raise e


class TimedIterator:
    """Times each next() of the iterator it holds; everything else passes through."""

    __slots__ = ("__weakref__", "_count", "_done", "_gen", "_it", "_last", "_owner", "_rec",
                 "_start")

    def __init__(self, it: Any, owner: _Instruments, start_ns: int, gen: int = 0,
                 count: Counter = loader_len) -> None:
        self._it = it
        self._count = count
        self._owner = owner
        self._rec = owner.rec
        self._start = start_ns
        self._gen = gen
        self._last = 0
        self._done = False

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
            self._finish(False, e)  # not the end: a loop may skip a bad batch and go on
            raise
        t1 = perf_counter_ns()
        rec = self._rec
        rec.fetch.append(t1 - t0)
        if self._last:
            rec.step.append(t0 - self._last)
        else:
            self._owner.first_batch(batch, t1 - self._start)
        self._last = t1
        rec.last_batch_ns = t1
        rec.batches += 1
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


class DataLoader(torch.utils.data.DataLoader[T_co]):
    """torch.utils.data.DataLoader, instrumented. Same arguments, plus:

    name: the `loader` label (loaders sharing a name share series);
    metrics_dir: write snapshot files there for the sidecar (default $DATALOADER_EXPORTER_DIR);
    port: also serve /metrics in-process on this port;
    registry: a prometheus_client CollectorRegistry to use instead of the process default.
    """

    _dataloader_exporter_times_itself = True  # zerocode.SELF_TIMED: its hooks leave it be

    def __init__(self, dataset: torch.utils.data.Dataset[T_co], *args: Any,
                 name: str = "default", metrics_dir: str | None = None,
                 port: int | None = None, registry: Any = None, **kwargs: Any) -> None:
        # $DATALOADER_EXPORTER_SETTINGS first: a bad line fails here, before any work.
        args, kwargs = zerocode.apply_settings(name, (dataset, *args), kwargs)
        super().__init__(*args, **kwargs)
        self.name = name
        self.metrics_dir = metrics_dir
        self.port = port
        self.registry = registry  # an attribute, so frameworks that rebuild loaders keep it
        self._dle = _Instruments(name, registry, metrics_dir, port)
        zerocode.adopt(self, self._dle)  # a framework's copy over the same dataset inherits

    def __iter__(self) -> Any:
        return instrumented_iter(self, self._dle, zerocode.TORCH_ITER)

    def to_device(self, batch: Any, device: Any, non_blocking: bool = True) -> Any:
        """Moves a (nested) batch to `device` and times the transfer (see instrument.to_device)."""
        return self._dle.to_device(batch, device, non_blocking)

    # A pickled loader (sent to another process) uses that process's default registry; a
    # copy in this process keeps its registry.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_dle", None)
        state.pop("registry", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("registry", None)
        self.__dict__["_dle"] = _Instruments(self.name, self.registry, self.metrics_dir,
                                             self.port)
        zerocode.adopt(self, self.__dict__["_dle"])

    def __copy__(self) -> DataLoader[T_co]:
        new = type(self).__new__(type(self))
        new.__setstate__(self.__getstate__() | {"registry": self.registry})
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> DataLoader[T_co]:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        state = copy.deepcopy(self.__getstate__(), memo)
        new.__setstate__(state | {"registry": self.registry})
        return new


class WrappedLoader:
    """A loader someone else built, timed from the outside (see wrap())."""

    def __init__(self, loader: Any, name: str, metrics_dir: str | None, port: int | None,
                 registry: Any, dle: _Instruments | None = None) -> None:
        self.loader = loader
        self._dle = dle if dle is not None else _Instruments(name, registry, metrics_dir,
                                                              port)

    def __iter__(self) -> TimedIterator:
        dle = self._dle
        inner = zerocode.held_loaders(self.loader)
        with zerocode.measuring(self.loader):  # a zero-code hook on its class passes on
            if inner:
                return holder_iter(self.loader, inner, dle, iter)
            start = perf_counter_ns()
            dle.start_epoch(self.loader)
            it = iter(self.loader)
        return TimedIterator(it, dle, start, dle.track(it, None), loader_len)

    def __repr__(self) -> str:
        return f"<instrument.wrap of {self.loader!r}>"

    def __len__(self) -> int:
        return len(self.loader)

    def to_device(self, batch: Any, device: Any, non_blocking: bool = True) -> Any:
        """Moves a (nested) batch to `device` and times the transfer."""
        return self._dle.to_device(batch, device, non_blocking)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "loader" not in self.__dict__:
            raise AttributeError(name)
        attr = getattr(self.loader, name)
        if inspect.ismethod(attr) and attr.__self__ is self.loader:
            return self._chained(name, attr)
        return attr

    def _chained(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        """A method of the loader whose result, when it is the loader or a new one of its
        class (webdataset's .unbatched(), .batched(n), .with_epoch(n)), is measured too,
        under the same name; another iterable result is said once to be unmeasured."""
        def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            if result is self.loader:
                return self
            if type(result) is type(self.loader):
                return WrappedLoader(result, self._dle.name, None, None, None, dle=self._dle)
            if _loader_like(result):
                envsettings.say_once(f"chain:{self._dle.name}:{name}", "dataloader %r: %s.%s() "
                                  "returned a %s, which is not measured: pass it to "
                                  "instrument.wrap() to measure it", log_name(self._dle.name),
                                  type(self.loader).__name__, name, type(result).__name__)
            return result

        return functools.wraps(method)(call)

    def __setattr__(self, name: str, value: Any) -> None:
        # Settings go to the loader, which accepts or refuses them as it would unwrapped.
        if name in _WRAPPER_OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)

    def __delattr__(self, name: str) -> None:
        if name in _WRAPPER_OWN:
            object.__delattr__(self, name)
        else:
            delattr(self.loader, name)


_WRAPPER_OWN = frozenset({"loader", "_dle"})


def _loader_like(obj: Any) -> bool:
    """An object a loop could iterate for batches (not a container, string or iterator)."""
    return (hasattr(type(obj), "__iter__") and not hasattr(type(obj), "__next__")
            and not isinstance(obj, (str, bytes, dict, list, tuple, set, frozenset)))


def wrap(loader: Any, name: str = "default", metrics_dir: str | None = None,
         port: int | None = None, registry: Any = None) -> Any:
    """Instruments a loader you did not construct (from a framework, say).

    A torch DataLoader (or anything that passes isinstance as one, like Accelerate's
    prepared loaders, or a subclass such as torchdata's StatefulDataLoader) is returned
    as it is, instrumented where its public __iter__ runs (zerocode.py): frameworks'
    isinstance checks still pass (so Lightning still adds its DistributedSampler), and its
    workers get the per-worker hook. A copy a framework builds over the same dataset keeps
    the name. An instrument.DataLoader or a loader wrapped already is returned unchanged
    (never counted twice); a loader that zero-code mode named takes this name instead.
    Anything else iterable is held by a WrappedLoader that times each next(); one that
    re-chunks a torch loader's batches (webdataset's WebLoader) is measured as the loop
    takes its batches, through its chain methods too.
    """
    known = zerocode.instruments(loader)
    if isinstance(loader, DataLoader) or (known is not None and known.explicit):
        return loader
    if isinstance(loader, WrappedLoader):
        return loader
    if isinstance(loader, torch.utils.data.DataLoader):
        zerocode.adopt(loader, _Instruments(name, registry, metrics_dir, port))
        return loader
    return WrappedLoader(loader, name, metrics_dir, port, registry)


def to_device(batch: Any, device: Any, non_blocking: bool = True, loader: Any = None) -> Any:
    """Moves nested tensors to `device`; timed when `loader` is instrumented.

    On CUDA the copy is bracketed by CUDA events read later (never a synchronize in
    the loop), so non_blocking copies still overlap compute; elsewhere the host time
    of the copy is measured.
    """
    dle = getattr(loader, "_dle", None) if isinstance(loader, (DataLoader, WrappedLoader)) else (
        zerocode.instruments(loader))
    if isinstance(dle, _Instruments):
        return dle.to_device(batch, device, non_blocking)
    return move(batch, torch.device(device), non_blocking)[0]
