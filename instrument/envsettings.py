"""$DATALOADER_EXPORTER_SETTINGS applied to a loader's constructor arguments.

A loader class's own ``__init__`` takes a setting as its named parameter (torch's
DataLoader, torchdata's StatefulDataLoader). A setting it does not name (a subclass that
takes ``**kwargs``, or that passes its own value on) is left for torch's ``__init__`` if
the class calls it, and otherwise named in one log line saying it was not applied
(zerocode/hooks.py).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.utils.data

from dataloader_exporter.core.envnames import getenv
from dataloader_exporter.core.logonce import LogOnce
from dataloader_exporter.core.settings import (
    AUTO,
    ENV_SETTINGS,
    NEEDS_WORKERS,
    SETTINGS,
    TUNABLE,
    TUNED_BY_DEFAULT,
    Setting,
    for_loader,
    log_name,
    named_loaders,
    parse,
    tuned,
)

log = logging.getLogger("dataloader_exporter.instrument")

_TORCH = inspect.signature(torch.utils.data.DataLoader.__init__)
_parsed: dict[str, tuple[Setting, ...]] = {}
_built: set[str] = set()  # names of loaders built while a settings line was set
# Warnings logged once per key in this process (settings, wrap(), zero-code mode's exit).
once = LogOnce(log)


@dataclass
class Pending:
    """Settings an outer __init__ could not pass, left for torch's."""

    name: str
    keys: tuple[str, ...]


def knobs_of(tune: bool | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """instrument.DataLoader's ``tune=``: True for num_workers and prefetch_factor, or the
    names of those it tunes (persistent_workers only when named: opt-in)."""
    if tune is True:
        return TUNED_BY_DEFAULT
    if tune is False:
        return ()
    names = tuple(tune)
    unknown = [n for n in names if n not in TUNABLE]
    if unknown or isinstance(tune, str):
        raise ValueError(f"tune: expected True, False or names among {', '.join(TUNABLE)}, "
                         f"got {tune!r}")
    return names


def from_env() -> tuple[Setting, ...]:
    """The parsed $DATALOADER_EXPORTER_SETTINGS (raises SettingsError when bad)."""
    line = getenv(ENV_SETTINGS)
    if line not in _parsed:
        _parsed[line] = parse(line)
    return _parsed[line]


def built() -> list[str]:
    return sorted(_built)


def auto_for(name: str) -> tuple[str, ...]:
    """The settings $DATALOADER_EXPORTER_SETTINGS gives the tuner for this loader name."""
    return tuned(from_env(), name)


def persistent_wish(name: str) -> bool:
    """Whether $DATALOADER_EXPORTER_SETTINGS gives this loader persistent_workers=true
    (which apply() leaves for the tuner where num_workers=auto and it has no workers yet)."""
    return for_loader(from_env(), name).get("persistent_workers") is True


def unmatched() -> set[str]:
    """Loader names the settings line gives that no loader built here had (only in a
    process that built loaders: a launcher builds none)."""
    if not _built:
        return set()
    return named_loaders(from_env()) - _built


@functools.cache
def _signature(function: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):
        return None


def apply(name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
          function: Callable[..., Any], only: tuple[str, ...] | None = None
          ) -> tuple[tuple[Any, ...], dict[str, Any], tuple[str, ...]]:
    """A loader's constructor arguments (without self) with its settings applied, and the
    settings `function` (its __init__) takes no way to pass.

    A setting that needs workers (prefetch_factor, persistent_workers) is not applied to
    a loader that has none, with a warning, rather than failing a loader built mid-run
    (persistent_workers=true beside num_workers=auto is the tuner's to apply, to the
    pools it starts: tuner/keep.py);
    num_workers=0 drops the loader's own prefetch_factor and persistent_workers, which
    torch refuses without workers. only: apply just these settings (the rest were).
    A setting given as ``auto`` is the tuner's (tuner/loop.py): the loader keeps its own
    value here.
    """
    settings = from_env()
    if not settings:
        return args, kwargs, ()
    _built.add(name)
    asked = for_loader(settings, name)
    wanted = {k: v for k, v in asked.items() if v != AUTO}
    if only is not None:
        wanted = {k: v for k, v in wanted.items() if k in only}
    sig = _signature(function)
    if not wanted or sig is None:
        return args, kwargs, tuple(wanted)
    try:
        bound = sig.bind(None, *args, **kwargs)
    except TypeError:  # the constructor will say what is wrong
        return args, kwargs, ()
    given = bound.arguments

    def place(key: str) -> dict[str, Any] | None:
        """Where a setting goes: a named parameter of the signature, else nowhere."""
        param = sig.parameters.get(key)
        if param is not None and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                inspect.Parameter.KEYWORD_ONLY):
            return given
        return None

    def current(key: str) -> Any:
        where = place(key)
        if where is not None and key in where:
            return where[key]
        param = sig.parameters.get(key)
        if param is not None and param.default is not inspect.Parameter.empty:
            return param.default
        return _TORCH.parameters[key].default

    # Without num_workers here, whether the loader has workers is torch's __init__'s to
    # see: the settings that need them are left for it.
    here = place("num_workers") is not None
    left = tuple(k for k in SETTINGS if k in wanted and (
        place(k) is None or (k in NEEDS_WORKERS and not here)))
    workers = wanted.get("num_workers", current("num_workers"))
    for key in SETTINGS:
        where = place(key)
        if key not in wanted or where is None or key in left:
            continue
        value = wanted[key]
        if key in NEEDS_WORKERS and not workers and value is not False:
            if key == "persistent_workers" and asked.get("num_workers") == AUTO:
                once.problem(f"later:{name}:{key}", "dataloader %r: %s.%s=%s: the tuner's "
                             "worker pools will be persistent (the loader has no workers "
                             "yet)", log_name(name), ENV_SETTINGS, key, value)
                continue
            once.problem(f"skip:{name}:{key}", "dataloader %r: %s.%s=%s not applied: the "
                         "loader has no workers", log_name(name), ENV_SETTINGS, key, value)
            continue
        before = current(key)
        where[key] = value
        if before != value:
            once.problem(f"set:{name}:{key}:{value}", "dataloader %r: %s=%s from %s (was %s)",
                         log_name(name), key, value, ENV_SETTINGS, before)
    if here and not workers:
        for key in NEEDS_WORKERS:
            where = place(key)
            default = _TORCH.parameters[key].default
            if where is not None and current(key) not in (default, None, False):
                where[key] = default
                once.problem(f"drop:{name}:{key}", "dataloader %r: %s dropped: %s sets "
                             "num_workers=0", log_name(name), key, ENV_SETTINGS)
    return bound.args[1:], bound.kwargs, left


def not_applied(name: str, cls: type, keys: tuple[str, ...]) -> None:
    """One line for settings a loader class takes no way to pass."""
    once.problem(f"left:{name}:{','.join(keys)}", "dataloader %r: %s for %s not applied: "
                 "%s.__init__ takes no such argument and does not pass it to torch's "
                 "DataLoader", log_name(name), ENV_SETTINGS, ", ".join(keys), cls.__qualname__)
