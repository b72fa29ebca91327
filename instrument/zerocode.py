"""Loaders nobody instrumented by hand: zero-code mode, framework copies, env settings.

Frameworks build and rebuild DataLoaders (Lightning adds a DistributedSampler, Accelerate's
prepare() builds its own loader around a fresh torch DataLoader, the HF Trainer builds
them itself). So the loaders are instrumented where every one of them passes: torch's
public ``DataLoader.__iter__`` (and, in zero-code mode, ``DataLoader.__init__``, for
names and settings), wrapped on the public class. Subclasses reach it through super();
torch's private iterator classes are never touched, and torch and the user still see
their own dataset, sampler, collate_fn and worker_init_fn (see loader.instrumented_iter).

Which loaders: those adopted by wrap() or instrument.DataLoader, and the copies a
framework's code (FRAMEWORKS) builds of them over the same dataset object, under the same
name; in zero-code mode (install(auto=True), see autorun/sitecustomize.py) every loader.
An instrument.DataLoader times itself and is never counted twice.

Names in zero-code mode, decided once when a loader is built, the same on every rank and
every restart, and as few as the roles and dataset classes a program has: the explicit
name of an instrumented loader over the same dataset; else the role of the framework
method building it (ROLES: Lightning's train_dataloader, the HF Trainer's
get_train_dataloader and so on); else the name a loader over the same dataset got; else
the dataset's class name.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import logging
import os
import re
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.utils.data

from exporter.loadersettings import (
    ENV_SETTINGS,
    NEEDS_WORKERS,
    Setting,
    for_loader,
    named_loaders,
    parse,
)

log = logging.getLogger("instrument")

_MARK = "__dataloader_exporter_original__"
_TorchDataLoader = torch.utils.data.DataLoader


def _original(attr: str) -> Any:
    f = vars(_TorchDataLoader)[attr]
    return getattr(f, _MARK, f)


TORCH_INIT: Callable[..., None] = _original("__init__")
TORCH_ITER: Callable[[Any], Any] = _original("__iter__")
_SIGNATURE = inspect.signature(TORCH_INIT)

# The framework methods that build loaders, and the name their loaders get.
ROLES: dict[str, str] = {
    "train_dataloader": "train", "get_train_dataloader": "train",
    "val_dataloader": "eval", "get_eval_dataloader": "eval", "eval_dataloader": "eval",
    "test_dataloader": "test", "get_test_dataloader": "test",
    "predict_dataloader": "predict",
}
STACK_DEPTH = 64  # frames searched for a role, once per loader built
# Packages whose loaders are copies of the user's when built over an adopted loader's dataset.
FRAMEWORKS = ("accelerate", "lightning", "lightning_fabric", "pytorch_lightning",
              "transformers")
_UNSAFE = re.compile(r"[^A-Za-z0-9_]")


@dataclass(frozen=True)
class Naming:
    """What a loader's copies inherit: its name and where its metrics go."""

    name: str
    registry: Any = None
    metrics_dir: str | None = None
    port: int | None = None
    explicit: bool = False


class _Table:
    """object -> value by identity, dropped when the object is collected."""

    def __init__(self) -> None:
        self._d: dict[int, tuple[weakref.ref[Any], Any]] = {}

    def get(self, obj: Any) -> Any:
        entry = self._d.get(id(obj))
        return entry[1] if entry is not None and entry[0]() is obj else None

    def put(self, obj: Any, value: Any) -> bool:
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

    def __bool__(self) -> bool:
        return bool(self._d)


_loaders = _Table()  # loader -> loader._Instruments
_datasets = _Table()  # dataset -> Naming
_own = _Table()  # plain loaders the user built over an adopted dataset (not copies)
_auto = False
_lock = threading.Lock()


# --- the hook on torch's public class -----------------------------------------------
def install(auto: bool = False) -> None:
    """Hooks DataLoader.__iter__ (for adopted loaders and their copies) and, with auto,
    DataLoader.__init__ too (every loader: zero-code mode). Idempotent."""
    global _auto
    with _lock:
        if auto:
            _auto = True
        hooks = {"__iter__": _hooked_iter, "__init__": _hooked_init}
        for attr, hook in hooks.items():
            if getattr(vars(_TorchDataLoader)[attr], _MARK, None) is None:
                setattr(_TorchDataLoader, attr, hook)
        if auto:
            _exit_report()


def _mark(original: Callable[..., Any]) -> Callable[[Callable[..., Any]], Any]:
    def deco(f: Callable[..., Any]) -> Any:
        f = functools.wraps(original)(f)
        setattr(f, _MARK, original)
        return f
    return deco


@_mark(TORCH_ITER)
def _hooked_iter(self: Any) -> Any:
    dle = _loaders.get(self)
    if dle is None and not (_auto or _datasets):  # a plain loader, nothing adopted: as torch
        return TORCH_ITER(self)
    from . import loader

    if dle is None:
        if isinstance(self, loader.DataLoader):
            return TORCH_ITER(self)
        try:
            dataset = getattr(self, "dataset", None)
            naming = _datasets.get(dataset) if dataset is not None else None
            if _auto:  # built before the hook was installed
                naming = naming or Naming(_class_name(dataset))
            elif naming is None or _own.get(self) or not built_by_framework():
                # Not a copy of an adopted loader that a framework iterates (Lightning
                # puts torch's own __init__ back after its hooks, hiding the copy it builds).
                return TORCH_ITER(self)
            dle = _instruments(self, naming)
        except Exception:  # instrumentation must never stop training
            log.warning("dataloader-exporter: cannot instrument %r", self, exc_info=True)
            return TORCH_ITER(self)
    return loader.instrumented_iter(self, dle, TORCH_ITER)


@_mark(TORCH_INIT)
def _hooked_init(self: Any, *args: Any, **kwargs: Any) -> None:
    from . import loader

    if isinstance(self, loader.DataLoader):  # names and settings are its own business
        TORCH_INIT(self, *args, **kwargs)
        return
    dataset = args[0] if args else kwargs.get("dataset")
    if not _auto:  # only a framework's copy of an adopted loader
        TORCH_INIT(self, *args, **kwargs)
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
    args, kwargs = apply_settings(naming.name, args, kwargs)  # may raise SettingsError
    TORCH_INIT(self, *args, **kwargs)
    try:
        _instruments(self, naming)
        if not naming.explicit:
            _datasets.put(dataset, naming)
    except Exception:
        log.warning("dataloader-exporter: cannot instrument %r", self, exc_info=True)


def _instruments(loader_obj: Any, naming: Naming) -> Any:
    from .loader import _Instruments

    dle = _Instruments(naming.name, naming.registry, naming.metrics_dir, naming.port,
                       explicit=False)
    _loaders.put(loader_obj, dle)
    return dle


def _naming_for(dataset: Any) -> Naming:
    inherited = _datasets.get(dataset) if dataset is not None else None
    if inherited is not None and inherited.explicit:
        return inherited
    role = role_from_stack()
    if role is not None:
        return Naming(role)
    return inherited or Naming(_class_name(dataset))


def built_by_framework(depth: int = STACK_DEPTH) -> bool:
    """Whether code of one of FRAMEWORKS is on the calling stack."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        module = frame.f_globals.get("__name__", "")
        if isinstance(module, str) and module.split(".", 1)[0] in FRAMEWORKS:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def role_from_stack(depth: int = STACK_DEPTH) -> str | None:
    """The role (ROLES) of the nearest framework method on the calling stack, or None."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        role = ROLES.get(frame.f_code.co_name)
        if role is not None:
            return role
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _class_name(dataset: Any) -> str:
    return _UNSAFE.sub("_", type(dataset).__name__)[:64] or "dataset"


# --- loaders instrumented by hand ---------------------------------------------------
def adopt(loader_obj: Any, dle: Any) -> None:
    """Instruments a loader through the hook, and the copies frameworks build of it."""
    install()
    _loaders.put(loader_obj, dle)
    naming = Naming(dle.name, dle.registry, dle.metrics_dir, dle.port, explicit=True)
    dataset = getattr(loader_obj, "dataset", None)
    if dataset is not None:
        _datasets.put(dataset, naming)
    with contextlib.suppress(TypeError):  # cannot tell when it goes: said at exit instead
        weakref.finalize(loader_obj, _collected, dle)
    _exit_report()


def instruments(loader_obj: Any) -> Any:
    """The instruments of an adopted or zero-code loader, or None."""
    return _loaders.get(loader_obj)


_unused: list[Any] = []  # instruments of explicit loaders collected without a batch


def _collected(dle: Any) -> None:
    if dle.explicit and not dle.iterated:
        _unused.append(dle)


def never_iterated() -> list[str]:
    """Names of loaders instrumented by hand that never gave a batch, whose name got no
    batch from any other loader either (a framework rebuilt them out of our sight)."""
    pending = list(_unused)
    for key in list(_loaders._d):
        entry = _loaders._d.get(key)
        dle = entry[1] if entry is not None and entry[0]() is not None else None
        if dle is not None and dle.explicit and not dle.iterated:
            pending.append(dle)
    names: list[str] = []
    for dle in pending:
        fed = any(r.name == dle.name and r.batches for r in dle.hub.recorders())
        if not fed and dle.name not in names:
            names.append(dle.name)
    return names


_said: set[str] = set()


def _say_once(key: str, msg: str, *args: object) -> None:
    if key not in _said:
        _said.add(key)
        log.warning(msg, *args)


_exit_registered: list[bool] = []


def _exit_report() -> None:
    """Registers the report below to run at exit, once."""
    if not _exit_registered:
        _exit_registered.append(True)
        atexit.register(_at_exit)


def _at_exit() -> None:
    try:
        for name in never_iterated():
            _say_once("unused:" + name, "dataloader %r was built but never iterated: a "
                      "framework probably rebuilt it and iterated its own copy, which was "
                      "not instrumented. Run the program under `dataloader-exporter run -- "
                      "...` (or set DATALOADER_EXPORTER_AUTO=1) to instrument every loader "
                      "without code changes.", name)
        for name in sorted(unmatched_settings()):
            _say_once("unmatched:" + name, "%s names loader %r, but no loader of that name "
                      "was built here (loaders built: %s)", ENV_SETTINGS, name,
                      ", ".join(sorted(_built)) or "none")
    except Exception:
        log.debug("exit report failed", exc_info=True)


# --- settings from the environment --------------------------------------------------
_parsed: dict[str, tuple[Setting, ...]] = {}
_built: set[str] = set()  # names of loaders built while a settings line was set


def settings_from_env() -> tuple[Setting, ...]:
    """The parsed $DATALOADER_EXPORTER_SETTINGS (raises SettingsError when bad)."""
    line = os.environ.get(ENV_SETTINGS, "")
    if line not in _parsed:
        _parsed[line] = parse(line)
    return _parsed[line]


def unmatched_settings() -> set[str]:
    """Loader names the settings line gives that no loader built here had (only in a
    process that built loaders: a launcher builds none)."""
    if not _built:
        return set()
    return named_loaders(settings_from_env()) - _built


def apply_settings(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """torch DataLoader arguments (without self) with this loader's settings applied.

    A setting that needs workers (prefetch_factor, persistent_workers) is not applied to
    a loader that has none, with a warning, rather than failing a loader built mid-run;
    num_workers=0 drops the loader's own prefetch_factor and persistent_workers, which
    torch refuses without workers.
    """
    settings = settings_from_env()
    if not settings:
        return args, kwargs
    _built.add(name)
    _exit_report()
    wanted = for_loader(settings, name)
    if not wanted:
        return args, kwargs
    try:
        bound = _SIGNATURE.bind(None, *args, **kwargs)
    except TypeError:  # torch will say what is wrong
        return args, kwargs
    given = bound.arguments

    def current(key: str) -> Any:
        return given.get(key, _SIGNATURE.parameters[key].default)

    workers = wanted.get("num_workers", current("num_workers"))
    for key in ("num_workers", "prefetch_factor", "persistent_workers", "pin_memory"):
        if key not in wanted:
            continue
        value = wanted[key]
        if key in NEEDS_WORKERS and not workers and value is not False:
            _say_once(f"skip:{name}:{key}", "dataloader %r: %s.%s=%s not applied: the "
                      "loader has no workers", name, ENV_SETTINGS, key, value)
            continue
        before = current(key)
        given[key] = value
        if before != value:
            _say_once(f"set:{name}:{key}:{value}", "dataloader %r: %s=%s from %s (was %s)",
                      name, key, value, ENV_SETTINGS, before)
    if not workers:
        for key in NEEDS_WORKERS:
            default = _SIGNATURE.parameters[key].default
            if current(key) not in (default, None, False):
                given[key] = default
                _say_once(f"drop:{name}:{key}", "dataloader %r: %s dropped: %s sets "
                          "num_workers=0", name, key, ENV_SETTINGS)
    return bound.args[1:], bound.kwargs
