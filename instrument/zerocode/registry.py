"""What the DataLoader hooks (hooks.py) know: which loaders are instrumented and
under which name, which hook is the outermost one running in this thread, and what is
said at exit about loaders that gave no batch.

Loaders and datasets are remembered by identity and forgotten when they are collected,
so nothing here keeps a user's object alive.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeGuard, TypeVar

from dataloader_exporter.core.envnames import ENV_SETTINGS
from dataloader_exporter.core.settings import log_name

from .. import envsettings
from ..instruments import Instruments
from ..torch_originals import MARK, TORCH_ITER

log = logging.getLogger("dataloader_exporter.instrument")

V = TypeVar("V")


@dataclass(frozen=True)
class Naming:
    """What a loader's copies inherit: its name and where its metrics go."""

    name: str
    registry: Any = None
    metrics_dir: str | None = None
    port: int | None = None
    explicit: bool = False


class IdentityTable(Generic[V]):
    """object -> value by identity, dropped when the object is collected."""

    def __init__(self) -> None:
        self._d: dict[int, tuple[weakref.ref[Any], V]] = {}

    def get(self, obj: Any) -> V | None:
        entry = self._d.get(id(obj))
        return entry[1] if entry is not None and entry[0]() is obj else None

    def put(self, obj: Any, value: V, then: Callable[[V], None] | None = None) -> bool:
        """Remembers value for obj; then(value) is called once obj is collected."""
        key = id(obj)

        def gone(ref: weakref.ref[Any], key: int = key) -> None:
            entry = self._d.get(key)
            if entry is not None and entry[0] is ref:
                del self._d[key]
                if then is not None:
                    then(entry[1])

        try:
            self._d[key] = (weakref.ref(obj, gone), value)
        except TypeError:  # not weak-referenceable: not remembered
            return False
        return True

    def values(self) -> list[V]:
        return [v for ref, v in list(self._d.values()) if ref() is not None]

    def __bool__(self) -> bool:
        return bool(self._d)


by_loader: IdentityTable[Instruments] = IdentityTable()  # loader -> its Instruments
by_dataset: IdentityTable[Naming] = IdentityTable()  # dataset -> Naming
# The plain loaders the user built over an adopted loader's dataset (not copies).
user_built: IdentityTable[bool] = IdentityTable()
# The torch loaders a holder (holders.py) iterates -> the holder's Instruments.
held_by: IdentityTable[Instruments] = IdentityTable()


class Mode:
    """Whether zero-code mode is on (every torch loader instrumented); set by install()."""

    auto = False


# --- the outermost hook running, per thread ---------------------------------------------
_tls = threading.local()  # .outer: {(id(obj), kind): state} of the outermost hook running


class outermost:  # a context manager, lower case as contextlib's are
    """Marks the outermost hook of `kind` running for obj in this thread (hooks it reaches
    through super() pass straight on) for the `with` block; `as` gives `state`. A class,
    not contextlib.contextmanager: a loader rebuilt every epoch enters it at each build
    and iter(), and the generator's four functions would each write pages a fork shares."""

    __slots__ = ("_key", "_outer", "_state")

    def __init__(self, obj: Any, kind: str, state: Any = None) -> None:
        self._key = (id(obj), kind)
        self._state = state

    def __enter__(self) -> Any:
        self._outer: dict[tuple[int, str], Any] = _tls.__dict__.setdefault("outer", {})
        self._outer[self._key] = self._state
        return self._state

    def __exit__(self, *exc: object) -> None:
        self._outer.pop(self._key, None)


def inside(obj: Any, kind: str) -> bool:
    """Whether a hook of `kind` for obj is running further up this thread's stack."""
    outer: dict[tuple[int, str], Any] | None = _tls.__dict__.get("outer")
    return bool(outer) and (id(obj), kind) in outer  # type: ignore[operator]


def outer_state(obj: Any, kind: str) -> Any:
    """The state the outermost hook of `kind` for obj left for inner ones, or None."""
    return _tls.__dict__.get("outer", {}).get((id(obj), kind))


@contextlib.contextmanager
def measuring(obj: Any) -> Iterator[None]:
    """wrap() measures obj's iteration: hooks it reaches pass straight on."""
    with outermost(obj, "iter"):
        yield


# --- the loaders --------------------------------------------------------------------------
def instruments(loader_obj: Any) -> Instruments | None:
    """The instruments of an adopted or zero-code loader, or None."""
    return by_loader.get(loader_obj)


def instrument_as(loader_obj: Any, naming: Naming) -> Instruments:
    """New instruments for a loader that zero-code mode or a framework's copy names."""
    inst = Instruments(naming.name, naming.registry, naming.metrics_dir, naming.port,
                       explicit=False)
    inst.loader_class = type(loader_obj)
    by_loader.put(loader_obj, inst)
    return inst


_unused: list[Instruments] = []  # instruments of explicit loaders collected without a batch


def collected(inst: Instruments) -> None:
    """An explicit loader was garbage-collected: remembered for the exit report if it
    never gave a batch."""
    if inst.explicit and not inst.iterated:
        _unused.append(inst)


def unmeasured() -> list[tuple[str, type]]:
    """Zero-code loaders whose class iterates in a way no hook sees, never measured."""
    out: list[tuple[str, type]] = []
    for inst in by_loader.values():
        cls = inst.loader_class
        if not inst.explicit and not inst.iterated and unmeasurable(cls):
            out.append((inst.name, cls))
    return out


def never_iterated() -> list[str]:
    """Names of loaders instrumented by hand that never gave a batch, whose name got no
    batch from any other loader either (a framework rebuilt them out of our sight)."""
    pending = list(_unused) + [i for i in by_loader.values() if i.explicit and not i.iterated]
    names: list[str] = []
    for inst in pending:
        fed = any(r.name == inst.name and r.batches for r in inst.hub.recorders())
        if not fed and inst.name not in names:
            names.append(inst.name)
    return names


def unmeasurable(cls: type | None) -> TypeGuard[type]:
    """Whether iterating a DataLoader of this class runs no hook of ours: an __iter__ that
    is a generator function (hooks leave those alone, as they usually call torch's later)
    in a class of its own."""
    it = getattr(cls, "__iter__", None)
    return (cls is not None and inspect.isgeneratorfunction(it) and not hasattr(it, MARK)
            and it is not TORCH_ITER)


def _classes_of(name: str) -> list[type]:
    pending = list(_unused) + by_loader.values()
    classes = [i.loader_class for i in pending if i.name == name]
    return [cls for cls in classes if unmeasurable(cls)]


# --- the exit report ---------------------------------------------------------------------
_exit_registered: list[bool] = []


def report_at_exit() -> None:
    """Registers the exit report (_at_exit) to run at interpreter exit, once."""
    if not _exit_registered:
        _exit_registered.append(True)
        atexit.register(_at_exit)


def _at_exit() -> None:
    """One line per loader that gave no batch, saying why and what would measure it, and
    one per name the settings line gives that no loader here had."""
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
            elif Mode.auto:  # zero-code mode sees every torch loader iterate: nothing did
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
