"""Loaders nobody instrumented by hand: zero-code mode, framework copies, data libraries.

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
sampler, collate_fn and worker_init_fn (see timed.instrumented_iter).

Holders: an object that is not a DataLoader but holds one and re-chunks its batches
(HOLDERS: webdataset's WebLoader, whose ``.unbatched().batched(n)`` makes the batches the
loop takes) is measured where the loop iterates it: its torch loader then only reports
its workers and settings ("held", quiet), so batches are counted once, as the loop saw
them. wrap() of a holder does the same, and keeps measuring through its chain methods.

Which loaders: those adopted by wrap() or instrument.DataLoader, and the copies a
framework's code (naming.FRAMEWORKS) builds of them over the same dataset object, under
the same name; in zero-code mode (install(auto=True), see autorun/sitecustomize.py) every
loader. An instrument.DataLoader times itself and is never counted twice.

Names in zero-code mode, decided once when a loader is built: the explicit name of an
instrumented loader over the same dataset; else the role of the framework method
building it (naming.ROLES); else, for a framework's copy, the name of the loader it
copies (the one over the same dataset); else the place in the user's code that built it
(naming.site_name: ``train.py:42``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any, Generic, TypeGuard, TypeVar

import torch.utils.data

from dataloader_exporter.core.env import ENV_SETTINGS
from dataloader_exporter.core.settings import log_name

from . import envsettings
from .batch import loader_len
from .instruments import Instruments
from .naming import built_by_framework, class_name, role_from_stack, site_name
from .originals import MARK, SELF_TIMED, TORCH_INIT, TORCH_ITER, is_lazy, self_timed
from .timed import TimedIterator, counter_for, instrumented_iter, prestart

log = logging.getLogger("dataloader_exporter.instrument")

_TorchDataLoader = torch.utils.data.DataLoader
# Classes (module.qualname) that hold a torch DataLoader in `pipeline` and re-chunk its
# batches before the loop takes them.
HOLDERS = frozenset({"webdataset.compat.WebLoader"})
_INIT, _ITER, _STATE = "__init__", "__iter__", "state_dict"
V = TypeVar("V")

__all__ = ["TORCH_INIT", "TORCH_ITER", "adopt", "install", "instruments", "never_iterated",
           "role_from_stack"]


@dataclass(frozen=True)
class Naming:
    """What a loader's copies inherit: its name and where its metrics go."""

    name: str
    registry: Any = None
    metrics_dir: str | None = None
    port: int | None = None
    explicit: bool = False


class _Table(Generic[V]):
    """object -> value by identity, dropped when the object is collected."""

    def __init__(self) -> None:
        self._d: dict[int, tuple[weakref.ref[Any], V]] = {}

    def get(self, obj: Any) -> V | None:
        entry = self._d.get(id(obj))
        return entry[1] if entry is not None and entry[0]() is obj else None

    def put(self, obj: Any, value: V) -> bool:
        key = id(obj)

        def gone(ref: weakref.ref[Any], key: int = key) -> None:
            entry = self._d.get(key)
            if entry is not None and entry[0] is ref:
                del self._d[key]

        try:
            self._d[key] = (weakref.ref(obj, gone), value)
        except TypeError:  # not weak-referenceable: not remembered
            return False
        return True

    def values(self) -> list[V]:
        return [v for ref, v in list(self._d.values()) if ref() is not None]

    def __bool__(self) -> bool:
        return bool(self._d)


_loaders: _Table[Instruments] = _Table()  # loader -> its Instruments
_datasets: _Table[Naming] = _Table()  # dataset -> Naming
_own: _Table[bool] = _Table()  # plain loaders the user built over an adopted dataset
_held: _Table[Instruments] = _Table()  # torch loaders a holder iterates -> its Instruments
_auto = False
_lock = threading.Lock()
_tls = threading.local()  # .outer: {(id(obj), kind): state} of the outermost hook running


# --- the hooks ------------------------------------------------------------------------
def install(auto: bool = False) -> None:
    """Hooks torch's DataLoader and its subclasses: __iter__ (adopted loaders and their
    copies) and, with auto, __init__ too (every loader: zero-code mode). Idempotent."""
    global _auto
    with _lock:
        if auto:
            _auto = True
        for attr, hook in (("__iter__", _hooked_iter), ("__init__", _hooked_init)):
            if getattr(vars(_TorchDataLoader)[attr], MARK, None) is None:
                setattr(_TorchDataLoader, attr, hook)
        if getattr(vars(_TorchDataLoader).get("__init_subclass__"), "__func__", None) is not (
                _on_subclass):
            _TorchDataLoader.__init_subclass__ = classmethod(_on_subclass)  # type: ignore[assignment]
        for cls in _subclasses(_TorchDataLoader):
            _hook_class(cls)
        if auto:
            _exit_report()


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
    the first iter(): they get their hook there (timed.prestart)."""
    @_mark(original)
    def hooked(self: Any) -> Any:
        dle = _loaders.get(self)
        if dle is None or self_timed(self):
            return original(self)
        return prestart(self, dle, original)
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


@contextlib.contextmanager
def _outermost(obj: Any, kind: str, state: Any = None) -> Iterator[Any]:
    """Marks the outermost hook of `kind` running for obj in this thread (hooks it reaches
    through super() pass straight on)."""
    outer = _tls.__dict__.setdefault("outer", {})
    key = (id(obj), kind)
    outer[key] = state
    try:
        yield state
    finally:
        outer.pop(key, None)


def _inside(obj: Any, kind: str) -> bool:
    outer: dict[tuple[int, str], Any] | None = _tls.__dict__.get("outer")
    return bool(outer) and (id(obj), kind) in outer  # type: ignore[operator]


def _window_state(obj: Any, kind: str) -> Any:
    return _tls.__dict__.get("outer", {}).get((id(obj), kind))


@_mark(TORCH_ITER)
def _hooked_iter(self: Any) -> Any:
    return _iter_via(self, TORCH_ITER)


@_mark(TORCH_INIT)
def _hooked_init(self: Any, *args: Any, **kwargs: Any) -> None:
    _init_via(self, TORCH_INIT, args, kwargs)


def _iter_via(self: Any, original: Callable[[Any], Any]) -> Any:
    if _inside(self, "iter") or is_lazy(original):  # an outer hook, or torch's later, measures
        return original(self)
    held = _held.get(self)
    dle = _loaders.get(self)
    if held is None and dle is None and not (_auto or _datasets):
        return original(self)  # a plain loader, nothing adopted: as torch
    if self_timed(self):
        return original(self)
    if held is not None:  # a holder measures the batches; this reports its workers
        with _outermost(self, "iter"):
            return instrumented_iter(self, held, original, quiet=True)
    if dle is None:
        try:
            dataset = getattr(self, "dataset", None)
            naming = _datasets.get(dataset) if dataset is not None else None
            if _auto:  # built before the hook was installed
                naming = naming or Naming(class_name(dataset))
            elif naming is None or _own.get(self) or not built_by_framework():
                # Not a copy of an adopted loader that a framework iterates (Lightning
                # puts torch's own __init__ back after its hooks, hiding the copy it builds).
                return original(self)
            dle = _instruments(self, naming)
        except Exception:  # instrumentation must never stop training
            log.warning("dataloader-exporter: cannot instrument %r", self, exc_info=True)
            return original(self)
    with _outermost(self, "iter"):
        return instrumented_iter(self, dle, original)


def _init_via(self: Any, original: Callable[..., None], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> None:
    if self_timed(self):  # an instrument.DataLoader: names and settings are its own business
        original(self, *args, **kwargs)
        return
    if _inside(self, "init"):  # through super(): the outer hook names it; it may have
        pending = _window_state(self, "init")  # left settings its signature lacks to torch
        if pending is not None and pending.keys and original is TORCH_INIT:
            args, kwargs, pending.keys = envsettings.apply(pending.name, args, kwargs,
                                                           original, pending.keys)
        original(self, *args, **kwargs)
        return
    dataset = args[0] if args else kwargs.get("dataset")
    if not _auto:  # only a framework's copy of an adopted loader
        with _outermost(self, "init"):
            original(self, *args, **kwargs)
        naming = _datasets.get(dataset) if dataset is not None else None
        if naming is not None and built_by_framework():
            try:
                _instruments(self, naming)
            except Exception:
                log.warning("dataloader-exporter: cannot instrument %r", self, exc_info=True)
        elif naming is not None:  # the user's own plain loader over that dataset: not a copy
            _own.put(self, True)
        return
    naming = _naming_for(dataset)
    # May raise SettingsError; what the class's signature cannot take is left for torch's
    # __init__, if this one reaches it.
    args, kwargs, left = envsettings.apply(naming.name, args, kwargs, original)
    pending = envsettings.Pending(naming.name, left)
    try:  # before its __init__ runs, which may iterate it (timm's MultiEpochsDataLoader)
        _instruments(self, naming)
    except Exception:
        log.warning("dataloader-exporter: cannot instrument %r", self, exc_info=True)
    with _outermost(self, "init", pending):
        original(self, *args, **kwargs)
    if pending.keys:
        envsettings.not_applied(naming.name, type(self), pending.keys)
    try:
        if not naming.explicit:
            _datasets.put(dataset, naming)
        holder = _holder_on_stack()
        if holder is not None:
            _hook_holder(type(holder))
    except Exception:
        log.warning("dataloader-exporter: cannot instrument %r", self, exc_info=True)


def _instruments(loader_obj: Any, naming: Naming) -> Instruments:
    dle = Instruments(naming.name, naming.registry, naming.metrics_dir, naming.port,
                       explicit=False)
    dle.loader_class = type(loader_obj)
    _loaders.put(loader_obj, dle)
    return dle


def _naming_for(dataset: Any) -> Naming:
    inherited = _datasets.get(dataset) if dataset is not None else None
    if inherited is not None and inherited.explicit:
        return inherited
    role = role_from_stack()
    if role is not None:
        return Naming(role)
    if inherited is not None and built_by_framework():  # a framework's copy of a loader
        return inherited
    return Naming(site_name() or class_name(dataset))


# --- holders (webdataset's WebLoader) ---------------------------------------------------
def is_holder(obj: Any) -> bool:
    return any(f"{k.__module__}.{k.__qualname__}" in HOLDERS for k in type(obj).__mro__)


def held_loaders(obj: Any) -> list[Any]:
    """The torch DataLoaders a holder iterates (its `pipeline`); [] for anything else."""
    if not is_holder(obj):
        return []
    pipeline = getattr(obj, "pipeline", None)
    if not isinstance(pipeline, list):
        return []
    return [s for s in pipeline if isinstance(s, _TorchDataLoader)]


def hold(inner: list[Any], dle: Instruments) -> None:
    """From now on these loaders' iterations report to a holder's instruments, quietly."""
    install()
    for obj in inner:
        _held.put(obj, dle)


def _holder_on_stack() -> Any:
    """The holder whose __init__ is building a loader right now, if any."""
    frame = inspect.currentframe()
    for _ in range(16):
        if frame is None:
            return None
        if frame.f_code.co_name == "__init__":
            obj = frame.f_locals.get("self")
            if obj is not None and not isinstance(obj, _TorchDataLoader) and is_holder(obj):
                return obj
        frame = frame.f_back
    return None


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
    if _inside(self, "iter"):  # wrap() of it measures
        return original(self)
    inner = held_loaders(self)
    dle = next((d for d in map(_loaders.get, inner) if d is not None), None)
    if dle is None:
        return original(self)
    with _outermost(self, "iter"):
        return holder_iter(self, inner, dle, original)


def holder_iter(holder: Any, inner: list[Any], dle: Instruments,
                iterate: Callable[[Any], Any]) -> TimedIterator:
    """iter() of a holder (webdataset's WebLoader) that iterates the torch loaders
    `inner`: its batches timed and counted as the loop takes them; the torch loaders'
    iterations report their workers only (hold)."""
    start = perf_counter_ns()
    hold(inner, dle)
    dle.start_epoch(inner[0])
    rechunked = len(getattr(holder, "pipeline", ())) > len(inner)
    count = loader_len if rechunked else counter_for(inner[0])
    return TimedIterator(iterate(holder), dle, start, 0, count)


@contextlib.contextmanager
def measuring(obj: Any) -> Iterator[None]:
    """wrap() measures obj's iteration: hooks it reaches pass straight on."""
    with _outermost(obj, "iter"):
        yield


# --- loaders instrumented by hand ---------------------------------------------------
def adopt(loader_obj: Any, dle: Instruments) -> None:
    """Instruments a loader through the hook, and the copies frameworks build of it."""
    install()
    _loaders.put(loader_obj, dle)
    dle.loader_class = type(loader_obj)
    naming = Naming(dle.name, dle.registry, dle.metrics_dir, dle.port, explicit=True)
    dataset = getattr(loader_obj, "dataset", None)
    if dataset is not None:
        _datasets.put(dataset, naming)
    with contextlib.suppress(TypeError):  # cannot tell when it goes: said at exit instead
        weakref.finalize(loader_obj, _collected, dle)
    _exit_report()


def instruments(loader_obj: Any) -> Instruments | None:
    """The instruments of an adopted or zero-code loader, or None."""
    return _loaders.get(loader_obj)


_unused: list[Instruments] = []  # instruments of explicit loaders collected without a batch


def _collected(dle: Instruments) -> None:
    if dle.explicit and not dle.iterated:
        _unused.append(dle)


def unmeasured() -> list[tuple[str, type]]:
    """Zero-code loaders whose class iterates in a way no hook sees, never measured."""
    out: list[tuple[str, type]] = []
    for dle in _loaders.values():
        cls = dle.loader_class
        if not dle.explicit and not dle.iterated and unmeasurable(cls):
            out.append((dle.name, cls))
    return out


def never_iterated() -> list[str]:
    """Names of loaders instrumented by hand that never gave a batch, whose name got no
    batch from any other loader either (a framework rebuilt them out of our sight)."""
    pending = list(_unused) + [d for d in _loaders.values() if d.explicit and not d.iterated]
    names: list[str] = []
    for dle in pending:
        fed = any(r.name == dle.name and r.batches for r in dle.hub.recorders())
        if not fed and dle.name not in names:
            names.append(dle.name)
    return names


_exit_registered: list[bool] = []


def _exit_report() -> None:
    """Registers the report below to run at exit, once."""
    if not _exit_registered:
        _exit_registered.append(True)
        atexit.register(_at_exit)


def unmeasurable(cls: type | None) -> TypeGuard[type]:
    """Whether iterating a DataLoader of this class runs no hook of ours: an __iter__ that
    is a generator function (hooks leave those alone, as they usually call torch's later,
    see _hook_class) in a class of its own."""
    it = getattr(cls, "__iter__", None)
    return (cls is not None and inspect.isgeneratorfunction(it) and not hasattr(it, MARK)
            and it is not TORCH_ITER)


def _classes_of(name: str) -> list[type]:
    pending = list(_unused) + _loaders.values()
    classes = [d.loader_class for d in pending if d.name == name]
    return [cls for cls in classes if unmeasurable(cls)]


def _at_exit() -> None:
    try:
        for name in never_iterated():
            odd = _classes_of(name)
            if odd:  # neither mode can time it: say so, and what would
                envsettings.once.problem(
                    "unused:" + name, "dataloader %r: no batch of it was measured. %s.__iter__"
                    " is a generator that does not go through torch's DataLoader.__iter__, "
                    "which neither dataloader_exporter.wrap() of the loader nor zero-code "
                    "mode can time; to measure it, time the loop's own iterator with "
                    "dataloader_exporter.wrap(iter(loader), name=...) each epoch",
                    log_name(name),
                    odd[0].__qualname__)
            elif _auto:  # zero-code mode sees every torch loader iterate: nothing did
                envsettings.once.problem("unused:" + name, "dataloader %r was built but "
                                         "never iterated in this process", log_name(name))
            else:
                envsettings.once.problem(
                    "unused:" + name, "dataloader %r was built but never iterated: a "
                    "framework probably rebuilt it and iterated its own copy, which was "
                    "not instrumented. Run the program under `dataloader-exporter run -- "
                    "...` (or set DATALOADER_EXPORTER_AUTO=1) to instrument every loader "
                    "without code changes.", log_name(name))
        for name, cls in unmeasured():
            envsettings.once.problem(
                "unused:" + name, "dataloader %r: no batch of it was measured. %s.__iter__ is "
                "a generator that does not go through torch's DataLoader.__iter__, which "
                "zero-code mode cannot time; to measure it, time the loop's own iterator with "
                "dataloader_exporter.wrap(iter(loader), name=...) each epoch", log_name(name),
                cls.__qualname__)
        for name in sorted(envsettings.unmatched()):
            envsettings.once.problem(
                "unmatched:" + name, "%s names loader %r, but no loader of that name was "
                "built here (loaders built: %s)", ENV_SETTINGS, log_name(name),
                ", ".join(map(log_name, envsettings.built())) or "none")
    except Exception:
        log.debug("exit report failed", exc_info=True)


def apply_settings(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """torch DataLoader arguments (without self) with this loader's settings applied (see
    envsettings.apply); instrument.DataLoader's __init__ takes torch's arguments."""
    _exit_report()
    args, kwargs, _ = envsettings.apply(name, args, kwargs, TORCH_INIT)
    return args, kwargs
