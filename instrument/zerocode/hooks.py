"""The hooks on torch's DataLoader: how loaders nobody instrumented by hand are measured.

Frameworks build and rebuild DataLoaders (Lightning adds a DistributedSampler, Accelerate's
prepare() builds its own loader around a fresh torch DataLoader, the HF Trainer builds
them itself), and data libraries subclass it without calling it (torchdata's
StatefulDataLoader re-implements ``__init__`` and ``__iter__``). So loaders are
instrumented where every one of them passes: the public ``__iter__`` (and, in zero-code
mode, ``__init__``, for names and settings) of torch's DataLoader and of each subclass
that defines its own, hooked on the class (subclasses defined later are hooked as they
are defined, through ``__init_subclass__``). Only the outermost hook of a call does the
work: one reached through ``super()`` passes straight on, so nothing is counted twice.
An ``__iter__`` that is a generator function (Accelerate's DataLoaderShard) runs
torch's later, lazily: it is left alone and measured where torch's runs. torch's private
iterator classes are never touched, and torch and the user still see their own dataset,
sampler, collate_fn and worker_init_fn (see iter_start.instrumented_iter).

Which loaders: those adopted by wrap() or instrument.DataLoader, and the copies a
framework's code (naming.FRAMEWORKS) builds of them over the same dataset object, under
the same name; in zero-code mode (install(auto=True), see autorun/sitecustomize.py) every
loader; and the torch loaders of a holder (holders.py). An instrument.DataLoader
times itself and is never counted twice. What the hooks remember: registry.py.

Names in zero-code mode, decided once when a loader is built: the explicit name of an
instrumented loader over the same dataset; else the role of the framework method
building it (naming.ROLES); else, for a framework's copy, the name of the loader it
copies (the one over the same dataset); else the place in the user's code that built it
(naming.site_name: ``train.py:42``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from time import perf_counter_ns
from typing import Any

import torch.utils.data

from .. import envsettings
from ..hotpath.batch import loader_len
from ..hotpath.iterator import TimedIterator
from ..instruments import Instruments
from ..iter_start import counter_for, instrumented_iter, prestart, timed_iterator
from ..naming import built_by_framework, class_name, role_from_stack, site_name, stack
from ..torch_originals import MARK, SELF_TIMED, TORCH_INIT, TORCH_ITER, is_lazy, self_timed
from .holders import held_loaders, holder_on_stack, rechunks
from .registry import (
    Mode,
    Naming,
    by_dataset,
    by_loader,
    collected,
    held_by,
    inside,
    instrument_as,
    outer_state,
    outermost,
    report_at_exit,
    user_built,
)

log = logging.getLogger("dataloader_exporter.instrument")

_TorchDataLoader = torch.utils.data.DataLoader
_INIT, _ITER, _STATE = "__init__", "__iter__", "state_dict"
_lock = threading.Lock()
_installed = False  # install() has hooked torch's class and its subclasses once

__all__ = ["TORCH_INIT", "TORCH_ITER", "adopt", "apply_settings", "holder_iter", "install",
           "role_from_stack"]


# --- the hooks ------------------------------------------------------------------------
def install(auto: bool = False) -> None:
    """Hooks torch's DataLoader and its subclasses: __iter__ (adopted loaders and their
    copies) and, with auto, __init__ too (every loader: zero-code mode). Idempotent: once
    installed, with torch's hooks still in place, a call does nothing more (subclasses
    defined since are hooked as they are defined, by __init_subclass__)."""
    global _installed
    own = vars(_TorchDataLoader)
    if _installed and not auto and own["__iter__"] is _hooked_iter and (
            own["__init__"] is _hooked_init):
        return
    with _lock:
        if auto:
            Mode.auto = True
        for attr, hook in (("__iter__", _hooked_iter), ("__init__", _hooked_init)):
            if getattr(vars(_TorchDataLoader)[attr], MARK, None) is None:
                setattr(_TorchDataLoader, attr, hook)
        if getattr(vars(_TorchDataLoader).get("__init_subclass__"), "__func__", None) is not (
                _on_subclass):
            _TorchDataLoader.__init_subclass__ = classmethod(_on_subclass)  # type: ignore[assignment]
        for cls in _subclasses(_TorchDataLoader):
            _hook_class(cls)
        _installed = True
        if auto:
            report_at_exit()


def _subclasses(cls: type) -> Iterator[type]:
    sub: type
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _mark(original: Callable[..., Any]) -> Callable[[Callable[..., Any]], Any]:
    def deco(f: Callable[..., Any]) -> Any:
        f = functools.wraps(original)(f)
        setattr(f, MARK, original)
        return f
    return deco


def _on_subclass(cls: type, **kwargs: Any) -> None:
    super(_TorchDataLoader, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
    with contextlib.suppress(Exception):  # defining a class must never fail because of us
        _hook_class(cls)


def _hook_class(cls: type) -> None:
    """Hooks a DataLoader subclass's own __init__ and (non-generator) __iter__."""
    if getattr(cls, SELF_TIMED, False):
        return
    own = vars(cls)
    init, it = own.get("__init__"), own.get("__iter__")
    if inspect.isfunction(init) and not hasattr(init, MARK):
        setattr(cls, _INIT, _init_hook(init))
    if inspect.isfunction(it) and not hasattr(it, MARK) and (
            not inspect.isgeneratorfunction(it)):
        setattr(cls, _ITER, _iter_hook(it))
    state = own.get(_STATE)
    if inspect.isfunction(state) and not hasattr(state, MARK):
        setattr(cls, _STATE, _state_hook(state))


def _state_hook(original: Callable[[Any], Any]) -> Any:
    """torchdata's StatefulDataLoader starts its workers in state_dict() when asked before
    the first iter(): they get their hook there (iter_start.prestart)."""
    @_mark(original)
    def hooked(self: Any) -> Any:
        instruments = by_loader.get(self)
        if instruments is None or self_timed(self):
            return original(self)
        return prestart(self, instruments, original)
    return hooked


def _init_hook(original: Callable[..., None]) -> Any:
    @_mark(original)
    def hooked(self: Any, *args: Any, **kwargs: Any) -> None:
        _init_via(self, original, args, kwargs)
    return hooked


def _iter_hook(original: Callable[[Any], Any]) -> Any:
    @_mark(original)
    def hooked(self: Any) -> Any:
        return _iter_via(self, original)
    return hooked


@_mark(TORCH_ITER)
def _hooked_iter(self: Any) -> Any:
    return _iter_via(self, TORCH_ITER)


@_mark(TORCH_INIT)
def _hooked_init(self: Any, *args: Any, **kwargs: Any) -> None:
    _init_via(self, TORCH_INIT, args, kwargs)


def _iter_via(self: Any, original: Callable[[Any], Any]) -> Any:
    if inside(self, "iter") or is_lazy(original):  # an outer hook, or torch's later, measures
        return original(self)
    held = held_by.get(self)
    instruments = by_loader.get(self)
    if held is None and instruments is None and not (Mode.auto or by_dataset):
        return original(self)  # a plain loader, nothing adopted: as torch
    if self_timed(self):
        return original(self)
    if held is not None:  # a holder measures the batches; this reports its workers
        with outermost(self, "iter"):
            return instrumented_iter(self, held, original, quiet=True)
    if instruments is None:
        try:
            dataset = getattr(self, "dataset", None)
            naming = by_dataset.get(dataset) if dataset is not None else None
            if Mode.auto:  # built before the hook was installed
                naming = naming or Naming(class_name(dataset))
            elif naming is None or user_built.get(self) or not built_by_framework():
                # Not a copy of an adopted loader that a framework iterates (Lightning
                # puts torch's own __init__ back after its hooks, hiding the copy it builds).
                return original(self)
            instruments = instrument_as(self, naming)
        except Exception:  # instrumentation must never stop training
            log.warning("dataloader-exporter: cannot instrument %r", self, exc_info=True)
            return original(self)
    with outermost(self, "iter"):
        return instrumented_iter(self, instruments, original)


def _init_via(self: Any, original: Callable[..., None], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> None:
    if self_timed(self):  # an instrument.DataLoader: names and settings are its own business
        original(self, *args, **kwargs)
        return
    if inside(self, "init"):  # through super(): the outer hook names it; it may have
        pending = outer_state(self, "init")  # left settings its signature lacks to torch
        if pending is not None and pending.keys and original is TORCH_INIT:
            args, kwargs, pending.keys = envsettings.apply(pending.name, args, kwargs,
                                                           original, pending.keys)
        original(self, *args, **kwargs)
        return
    dataset = args[0] if args else kwargs.get("dataset")
    if not Mode.auto:  # only a framework's copy of an adopted loader
        with outermost(self, "init"):
            original(self, *args, **kwargs)
        naming = by_dataset.get(dataset) if dataset is not None else None
        if naming is not None and built_by_framework():
            try:
                instrument_as(self, naming)
            except Exception:
                log.warning("dataloader-exporter: cannot instrument %r", self, exc_info=True)
        elif naming is not None:  # the user's own plain loader over that dataset: not a copy
            user_built.put(self, True)
        return
    naming = _naming_for(dataset)
    # May raise SettingsError; what the class's signature cannot take is left for torch's
    # __init__, if this one reaches it.
    args, kwargs, left = envsettings.apply(naming.name, args, kwargs, original)
    pending = envsettings.Pending(naming.name, left)
    try:  # before its __init__ runs, which may iterate it (timm's MultiEpochsDataLoader)
        instrument_as(self, naming)
    except Exception:
        log.warning("dataloader-exporter: cannot instrument %r", self, exc_info=True)
    with outermost(self, "init", pending):
        original(self, *args, **kwargs)
    if pending.keys:
        envsettings.not_applied(naming.name, type(self), pending.keys)
    try:
        if not naming.explicit:
            by_dataset.put(dataset, naming)
        holder = holder_on_stack()
        if holder is not None:
            _hook_holder(type(holder))
    except Exception:
        log.warning("dataloader-exporter: cannot instrument %r", self, exc_info=True)


def _naming_for(dataset: Any) -> Naming:
    inherited = by_dataset.get(dataset) if dataset is not None else None
    if inherited is not None and inherited.explicit:
        return inherited
    frames = stack()  # walked once for the three rules
    role = role_from_stack(frames=frames)
    if role is not None:
        return Naming(role)
    if inherited is not None and built_by_framework(frames=frames):  # a framework's copy
        return inherited
    return Naming(site_name(frames=frames) or class_name(dataset))


# --- holders (webdataset's WebLoader, holders.py) ---------------------------
def hold(inner: list[Any], instruments: Instruments) -> None:
    """From now on these loaders' iterations report to a holder's instruments, quietly."""
    install()
    for obj in inner:
        held_by.put(obj, instruments)


def _hook_holder(cls: type) -> None:
    """Measures a holder class's iteration (zero-code mode found it building a loader)."""
    with _lock:
        if hasattr(vars(cls).get("__iter__"), MARK):
            return
        original = cls.__iter__  # type: ignore[attr-defined]

        @_mark(original)
        def hooked(self: Any) -> Any:
            return _holder_iter(self, original)

        setattr(cls, _ITER, hooked)


def _holder_iter(self: Any, original: Callable[[Any], Any]) -> Any:
    if inside(self, "iter"):  # wrap() of it measures
        return original(self)
    inner = held_loaders(self)
    instruments = next((d for d in map(by_loader.get, inner) if d is not None), None)
    if instruments is None:
        return original(self)
    with outermost(self, "iter"):
        return holder_iter(self, inner, instruments, original)


def holder_iter(holder: Any, inner: list[Any], instruments: Instruments,
                iterate: Callable[[Any], Any]) -> TimedIterator:
    """iter() of a holder (webdataset's WebLoader) that iterates the torch loaders
    `inner`: its batches timed and counted as the loop takes them; the torch loaders'
    iterations report their workers only (hold)."""
    start = perf_counter_ns()
    hold(inner, instruments)
    instruments.start_epoch(inner[0])
    count = loader_len if rechunks(holder, inner) else counter_for(inner[0])
    return timed_iterator(iterate(holder), instruments, start, 0, count)


# --- loaders instrumented by hand ---------------------------------------------------
def adopt(loader_obj: Any, instruments: Instruments) -> None:
    """Instruments a loader through the hook, and the copies frameworks build of it."""
    install()
    by_loader.put(loader_obj, instruments, collected)
    instruments.loader_class = type(loader_obj)
    naming = Naming(instruments.name, instruments.registry, instruments.metrics_dir,
                    instruments.port, explicit=True)
    dataset = getattr(loader_obj, "dataset", None)
    if dataset is not None:
        by_dataset.put(dataset, naming)
    report_at_exit()


def apply_settings(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """torch DataLoader arguments (without self) with this loader's settings applied (see
    envsettings.apply); instrument.DataLoader's __init__ takes torch's arguments."""
    report_at_exit()
    args, kwargs, _ = envsettings.apply(name, args, kwargs, TORCH_INIT)
    return args, kwargs
