"""The instrumented DataLoader, and wrap() for loaders built elsewhere.

The training loop sees exactly what it would see without us: the same batches in the
same order, the same len() and the same exceptions, and torch sees the user's own
dataset, sampler and worker_init_fn (see hotpath/workerblock.py for the one hook,
collate_fn, that the workers get wrapped). The iterator the loop takes:
hotpath/iterator.py (two perf_counter_ns calls, two deque appends and a few integer
updates a batch), built at iter() by iter_start.py.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any, TypeVar

import torch
import torch.utils.data

from dataloader_exporter.core.settings import log_name

from . import envsettings, iter_start
from .hotpath.batch import loader_len, move
from .hotpath.iterator import TimedIterator
from .instruments import Instruments
from .iter_start import instrumented_iter, timed_iterator
from .torch_originals import TORCH_ITER
from .zerocode import hooks as zerocode_hooks
from .zerocode import registry as zerocode_registry
from .zerocode.holders import held_loaders

T_co = TypeVar("T_co", covariant=True)


class DataLoader(torch.utils.data.DataLoader[T_co]):
    """torch.utils.data.DataLoader, instrumented. Same arguments, plus:

    name: the `loader` label (loaders sharing a name share series);
    metrics_dir: write snapshot files there for the sidecar (default $DATALOADER_EXPORTER_DIR);
    port: also serve /metrics in-process on this port;
    registry: a prometheus_client CollectorRegistry to use instead of the process default;
    tune: True (num_workers and prefetch_factor), or the settings among ("num_workers",
    "prefetch_factor", "persistent_workers") the loader tuner sets, starting from the values
    given here (as ``auto`` in $DATALOADER_EXPORTER_SETTINGS does). Default: none.
    persistent_workers=True with num_workers=0 (which torch refuses) and a tuned
    num_workers makes the pools the tuner starts persistent.
    """

    _dataloader_exporter_times_itself = True  # torch_originals.SELF_TIMED: hooks leave it be

    def __init__(self, dataset: torch.utils.data.Dataset[T_co], *args: Any,
                 name: str = "default", metrics_dir: str | None = None,
                 port: int | None = None, registry: Any = None,
                 tune: bool | tuple[str, ...] = False, **kwargs: Any) -> None:
        knobs = envsettings.knobs_of(tune)  # a bad value fails here, as torch's own arguments do
        # persistent_workers=True beside a tuned num_workers of 0: torch refuses it without
        # workers, so the tuner makes the pools it starts persistent (tuner/keep.py).
        persist = ("num_workers" in knobs and len(args) < 5 and not kwargs.get("num_workers")
                   and kwargs.get("persistent_workers") is True)
        if persist:
            kwargs["persistent_workers"] = False
        # $DATALOADER_EXPORTER_SETTINGS first: a bad line fails here, before any work.
        args, kwargs = zerocode_hooks.apply_settings(name, (dataset, *args), kwargs)
        super().__init__(*args, **kwargs)
        self.name = name
        self.metrics_dir = metrics_dir
        self.port = port
        self.tune = knobs
        self.registry = registry  # an attribute, so frameworks that rebuild loaders keep it
        # Its Instruments (instruments.py): everything measured goes through them.
        self._instruments = Instruments(name, registry, metrics_dir, port, tune=knobs)
        self._instruments.persist = self.tune_persistent = persist
        # A framework's copy over the same dataset inherits its name.
        zerocode_hooks.adopt(self, self._instruments)

    def __iter__(self) -> Any:
        return instrumented_iter(self, self._instruments, TORCH_ITER)

    def to_device(self, batch: Any, device: Any, non_blocking: bool = True) -> Any:
        """Moves a (nested) batch to `device` and times the transfer (see instrument.to_device)."""
        return self._instruments.to_device(batch, device, non_blocking)

    # A pickled loader (sent to another process) uses that process's default registry; a
    # copy in this process keeps its registry.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_instruments", None)
        state.pop("registry", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("registry", None)
        self.__dict__.setdefault("tune", ())
        self.__dict__["_instruments"] = Instruments(self.name, self.registry, self.metrics_dir,
                                             self.port, tune=self.tune)
        self.__dict__["_instruments"].persist = self.__dict__.get("tune_persistent", False)
        zerocode_hooks.adopt(self, self.__dict__["_instruments"])

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


iter_start.PLAIN_LOADERS.add(DataLoader)


class WrappedLoader:
    """A loader someone else built, timed from the outside (see wrap())."""

    def __init__(self, loader: Any, name: str, metrics_dir: str | None, port: int | None,
                 registry: Any, instruments: Instruments | None = None) -> None:
        self.loader = loader
        self._instruments = instruments if instruments is not None else Instruments(
            name, registry, metrics_dir, port)

    def __iter__(self) -> TimedIterator:
        instruments = self._instruments
        inner = held_loaders(self.loader)
        # A zero-code hook on its class passes on.
        with zerocode_registry.measuring(self.loader):
            if inner:
                return zerocode_hooks.holder_iter(self.loader, inner, instruments, iter)
            start = perf_counter_ns()
            instruments.start_epoch(self.loader)
            it = iter(self.loader)
        return timed_iterator(it, instruments, start, instruments.track(it, None), loader_len)

    def __repr__(self) -> str:
        return f"<dataloader_exporter.wrap of {self.loader!r}>"

    def __len__(self) -> int:
        return len(self.loader)

    def to_device(self, batch: Any, device: Any, non_blocking: bool = True) -> Any:
        """Moves a (nested) batch to `device` and times the transfer."""
        return self._instruments.to_device(batch, device, non_blocking)

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
                return WrappedLoader(result, self._instruments.name, None, None, None,
                                     instruments=self._instruments)
            if _loader_like(result):
                own = self._instruments.name
                envsettings.once.problem(
                    f"chain:{own}:{name}", "dataloader %r: %s.%s() returned a %s, "
                    "which is not measured: pass it to dataloader_exporter.wrap() to measure it",
                    log_name(own), type(self.loader).__name__, name, type(result).__name__)
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


_WRAPPER_OWN = frozenset({"loader", "_instruments"})


def _loader_like(obj: Any) -> bool:
    """An object a loop could iterate for batches (not a container, string or iterator)."""
    return (hasattr(type(obj), "__iter__") and not hasattr(type(obj), "__next__")
            and not isinstance(obj, (str, bytes, dict, list, tuple, set, frozenset)))


def wrap(loader: Any, name: str = "default", metrics_dir: str | None = None,
         port: int | None = None, registry: Any = None) -> Any:
    """Instruments a loader you did not construct (from a framework, say).

    A torch DataLoader (or anything that passes isinstance as one, like Accelerate's
    prepared loaders, or a subclass such as torchdata's StatefulDataLoader) is returned
    as it is, instrumented where its public __iter__ runs (zerocode/hooks.py): frameworks'
    isinstance checks still pass (so Lightning still adds its DistributedSampler), and its
    workers get the per-worker hook. A copy a framework builds over the same dataset keeps
    the name. An instrument.DataLoader or a loader wrapped already is returned unchanged
    (never counted twice); a loader that zero-code mode named takes this name instead.
    Anything else iterable is held by a WrappedLoader that times each next(); one that
    re-chunks a torch loader's batches (webdataset's WebLoader) is measured as the loop
    takes its batches, through its chain methods too.
    """
    known = zerocode_registry.instruments(loader)
    if isinstance(loader, DataLoader) or (known is not None and known.explicit):
        return loader
    if isinstance(loader, WrappedLoader):
        return loader
    if isinstance(loader, torch.utils.data.DataLoader):
        zerocode_hooks.adopt(loader, Instruments(name, registry, metrics_dir, port))
        return loader
    return WrappedLoader(loader, name, metrics_dir, port, registry)


def to_device(batch: Any, device: Any, non_blocking: bool = True, loader: Any = None) -> Any:
    """Moves nested tensors to `device`; timed when `loader` is instrumented.

    On CUDA the copy is bracketed by CUDA events read later (never a synchronize in
    the loop), so non_blocking copies still overlap compute; elsewhere the host time
    of the copy is measured.
    """
    if isinstance(loader, (DataLoader, WrappedLoader)):
        instruments = getattr(loader, "_instruments", None)
    else:
        instruments = zerocode_registry.instruments(loader)
    if isinstance(instruments, Instruments):
        return instruments.to_device(batch, device, non_blocking)
    return move(batch, torch.device(device), non_blocking)[0]
