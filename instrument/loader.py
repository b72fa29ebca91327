"""The instrumented DataLoader, wrap() for loaders built elsewhere, and the timed iterator.

The training loop sees exactly what it would see without us: the same batches in the
same order, the same len() and the same exceptions. The per-batch cost is two
perf_counter_ns calls, two deque appends and a few integer updates.
"""

from __future__ import annotations

import logging
import os
from time import perf_counter_ns
from typing import Any

import torch
import torch.utils.data

from . import compat
from .batch import batch_len, batch_nbytes, move
from .env import current_rank
from .hub import ENV_DIR, Hub, hub_for
from .preflight import LoaderConfig, Preflight
from .recorder import LoaderRecorder
from .workers import TimedCollate, WorkerInit, new_block, timed_dataset

log = logging.getLogger("instrument")

BYTES_EVERY = 64  # batches between two samples of the batch size in bytes
MAX_PENDING_EVENTS = 4096  # CUDA event pairs kept waiting before the oldest are dropped


class _Instruments:
    """One loader object's link to its recorder, sinks and advice."""

    def __init__(self, name: str, registry: Any, metrics_dir: str | None,
                 port: int | None) -> None:
        self.name = name
        self.hub: Hub = hub_for(registry)
        self.preflight = Preflight(name)
        self.config = LoaderConfig(None, None, None, None, None)
        self.block: torch.Tensor | None = None
        self.epochs = 0
        self._rec: LoaderRecorder | None = None
        directory = metrics_dir or os.environ.get(ENV_DIR) or None
        if directory:
            self.hub.write_snapshots(directory)
        if port is not None:
            from .serve import serve

            try:
                serve(port, registry=self.hub.registry)
            except OSError as e:
                log.warning("dataloader %r: cannot serve metrics on port %s: %s "
                            "(training goes on)", name, port, e)

    @property
    def rec(self) -> LoaderRecorder:
        if self._rec is None:
            self._rec = self.hub.recorder(self.name, current_rank())
        return self._rec

    def start_epoch(self, loader: Any) -> None:
        self.epochs += 1
        self.config = LoaderConfig.of(loader)
        rec = self.rec
        rec.config = {"loader": self.name, "rank": rec.rank, **self.config.labels()}
        rec.epochs += 1
        try:
            self.preflight.on_iter(self.config, self.epochs)
        except Exception:  # advice must never stop training
            log.debug("preflight failed", exc_info=True)

    def worker_block(self, num_workers: int) -> torch.Tensor:
        if self.block is None or self.block.shape[0] < num_workers:
            self.block = new_block(num_workers)
            self.rec.workers.use_block(self.block)
        return self.block

    def first_batch(self, batch: Any, since_iter_ns: int) -> None:
        rec = self.rec
        rec.first.append(since_iter_ns)
        try:
            rec.batch_bytes = batch_nbytes(batch)
            self.preflight.on_first_batch(self.config, rec.batch_bytes)
        except Exception:
            log.debug("first-batch preflight failed", exc_info=True)

    def end(self, clean: bool) -> None:
        """The iterator ended: StopIteration (clean) or an exception."""
        rec = self.rec
        if not clean:
            rec.workers.refresh(0.0, on_error=True)
        if not self.config.persistent_workers:
            rec.workers.retire()
        self.hub.flush_now()

    def abandoned(self) -> None:
        """The iterator was dropped mid-epoch (break): torch shuts its workers down."""
        if not self.config.persistent_workers:
            self.rec.workers.retire()

    def to_device(self, batch: Any, device: Any, non_blocking: bool) -> Any:
        rec = self.rec
        dev = torch.device(device)
        if dev.type == "cuda":
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
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


class TimedIterator:
    """Times each next() of the iterator it holds; everything else passes through."""

    __slots__ = ("__weakref__", "_done", "_it", "_last", "_owner", "_rec", "_start")

    def __init__(self, it: Any, owner: _Instruments, start_ns: int) -> None:
        self._it = it
        self._owner = owner
        self._rec = owner.rec
        self._start = start_ns
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
        except Exception:
            self._finish(False)
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
            rec.samples += batch_len(batch)
            if not rec.batches % BYTES_EVERY:
                rec.batch_bytes = batch_nbytes(batch)
        except Exception:
            pass
        return batch

    def _finish(self, clean: bool) -> None:
        if not self._done:
            self._done = True
            try:
                self._owner.end(clean)
            except Exception:
                log.debug("metrics bookkeeping failed at end of epoch", exc_info=True)

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in TimedIterator.__slots__:
            raise AttributeError(name)
        return getattr(self._it, name)

    def __del__(self) -> None:
        try:
            if not self._done:
                self._done = True
                self._owner.abandoned()
        except Exception:
            pass


class DataLoader(torch.utils.data.DataLoader):
    """torch.utils.data.DataLoader, instrumented. Same arguments, plus:

    name: the `loader` label (loaders sharing a name share series);
    metrics_dir: write snapshot files there for the sidecar (default $DATALOADER_EXPORTER_DIR);
    port: also serve /metrics in-process on this port;
    registry: a prometheus_client CollectorRegistry to use instead of the process default.
    """

    def __init__(self, dataset: Any, *args: Any, name: str = "default",
                 metrics_dir: str | None = None, port: int | None = None,
                 registry: Any = None, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)
        self.name = name
        self.metrics_dir = metrics_dir
        self.port = port
        self._dle = _Instruments(name, registry, metrics_dir, port)

    def __iter__(self) -> Any:
        dle = self._dle
        start = perf_counter_ns()
        dle.start_epoch(self)
        if not self.num_workers:
            return TimedIterator(super().__iter__(), dle, start)
        # Public hooks only: the iterator reads dataset, collate_fn and worker_init_fn
        # while it starts the workers, so they see timed versions; we see ours after.
        block = dle.worker_block(self.num_workers)
        dataset, collate, init = self.dataset, self.collate_fn, self.worker_init_fn
        object.__setattr__(self, "dataset", timed_dataset(dataset))
        self.collate_fn = TimedCollate(collate)
        self.worker_init_fn = WorkerInit(block, init)
        try:
            it = super().__iter__()
        finally:
            object.__setattr__(self, "dataset", dataset)
            self.collate_fn = collate
            self.worker_init_fn = init
        # Workers announce their pids once started; until then the iterator knows them.
        dle.rec.workers.set_pids(compat.worker_pids(it))
        return TimedIterator(it, dle, start)

    def to_device(self, batch: Any, device: Any, non_blocking: bool = True) -> Any:
        """Moves a (nested) batch to `device` and times the transfer (see instrument.to_device)."""
        return self._dle.to_device(batch, device, non_blocking)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_dle", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__["_dle"] = _Instruments(self.name, None, self.metrics_dir, self.port)


class WrappedLoader:
    """A loader someone else built, timed from the outside (see wrap())."""

    def __init__(self, loader: Any, name: str, metrics_dir: str | None, port: int | None,
                 registry: Any) -> None:
        self.loader = loader
        self._dle = _Instruments(name, registry, metrics_dir, port)

    def __iter__(self) -> TimedIterator:
        dle = self._dle
        start = perf_counter_ns()
        dle.start_epoch(self.loader)
        it = iter(self.loader)
        dle.rec.workers.set_pids(compat.worker_pids(it))
        return TimedIterator(it, dle, start)

    def __len__(self) -> int:
        return len(self.loader)

    def to_device(self, batch: Any, device: Any, non_blocking: bool = True) -> Any:
        """Moves a (nested) batch to `device` and times the transfer."""
        return self._dle.to_device(batch, device, non_blocking)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "loader" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.loader, name)


def wrap(loader: Any, name: str = "default", metrics_dir: str | None = None,
         port: int | None = None, registry: Any = None) -> WrappedLoader:
    """Instruments a loader you did not construct (from a framework, say).

    Gives every metric but the per-worker ones, which need hooks installed before the
    workers start; worker liveness comes from the iterator (see compat.py).
    """
    return WrappedLoader(loader, name, metrics_dir, port, registry)


def to_device(batch: Any, device: Any, non_blocking: bool = True, loader: Any = None) -> Any:
    """Moves nested tensors to `device`; timed when `loader` is instrumented.

    On CUDA the copy is bracketed by CUDA events read later (never a synchronize in
    the loop), so non_blocking copies still overlap compute; elsewhere the host time
    of the copy is measured.
    """
    dle = getattr(loader, "_dle", None)
    if isinstance(dle, _Instruments):
        return dle.to_device(batch, device, non_blocking)
    return move(batch, torch.device(device), non_blocking)[0]
