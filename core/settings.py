"""DataLoader settings from the environment: one line, the Kubernetes ConfigMap way.

    DATALOADER_EXPORTER_SETTINGS="train.num_workers=8,train.prefetch_factor=4,*.persistent_workers=true"

``auto`` (num_workers, prefetch_factor and persistent_workers) hands the setting to the
loader tuner (core/tuner/rules.py): it starts from the loader's own value and changes it
as it measures; persistent_workers=auto keeps a pool across epochs where its start stalls
them (core/tuner/persist.py). persistent_workers=true beside num_workers=auto on a loader
built without workers makes the tuner's pools persistent.

Each item is ``LOADER.SETTING=VALUE``: a loader name (the ``loader`` label) or ``*`` for
every loader, one of SETTINGS, and its value. A named item wins over a ``*`` item for the
same setting. The instrumentation applies them when a loader is built; the doctor prints
its advice in the same format (format_settings), so advice becomes a ConfigMap line.

Stdlib only (the doctor and the `run` command use it without torch). Every problem in a
line is reported together, in one SettingsError, before anything runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from dataloader_exporter.core.envnames import ENV_SETTINGS
from dataloader_exporter.core.problems import Problems

ANY = "*"
AUTO = "auto"  # the loader tuner sets it (core/tuner/rules.py)

Value = int | bool | str  # str: only AUTO

# setting -> (kind, smallest value for integers)
SETTINGS: dict[str, tuple[type, int]] = {
    "num_workers": (int, 0),
    "prefetch_factor": (int, 1),
    "persistent_workers": (bool, 0),
    "pin_memory": (bool, 0),
}
# The largest integer each takes: a guard against typos and overflow, not advice. 1024
# worker processes is more than the hardware threads of any one host today (two 192-core
# sockets give 768), and 1024 batches queued per worker is 512 times torch's default of 2.
MAXIMA: dict[str, int] = {"num_workers": 1024, "prefetch_factor": 1024}
TUNABLE = ("num_workers", "prefetch_factor", "persistent_workers")  # the settings that take AUTO
TUNED_BY_DEFAULT = ("num_workers", "prefetch_factor")  # instrument.DataLoader's tune=True
NEEDS_WORKERS = ("prefetch_factor", "persistent_workers")  # torch refuses them without workers
_NAME = re.compile(r"^[A-Za-z0-9_.:-]+$")  # what a loader label may be (names have no '=' or ',')
_WHOLE = re.compile(r"[+-]?[0-9]+")  # ASCII digits only: int() also reads '\u0663' and '\uff18'
LOG_NAME_CHARS = 60  # a longer name is cut to this many characters in log lines


class SettingsError(Problems):
    """A settings line that cannot be applied; the message lists every problem."""


@dataclass(frozen=True)
class Setting:
    loader: str  # a loader name, or ANY
    name: str
    value: Value


def log_name(name: str) -> str:
    """A loader name for a log line, cut to LOG_NAME_CHARS and its length said: a name (or
    any text from the environment) can be 100 kB; a log line should not be. Labels keep
    the whole name."""
    if len(name) <= LOG_NAME_CHARS:
        return name
    return f"{name[:LOG_NAME_CHARS]}\u2026({len(name)} chars)"


def parse_bool(text: str) -> bool | None:
    """'true', 'yes', 'on', '1' / 'false', 'no', 'off', '0' (any case); None otherwise.
    The one reading of a switch, for settings lines and the sidecar's flags alike."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return None


def _value(kind: type, least: int, most: int | None, raw: str, auto: bool = False) -> Value:
    text = raw.strip().lower()
    if auto and text == AUTO:
        return AUTO
    if kind is bool:
        switch = parse_bool(text)
        if switch is None:
            raise ValueError("expected true or false" + (" or auto" if auto else ""))
        return switch
    if not _WHOLE.fullmatch(text):
        raise ValueError("expected a whole number (digits 0-9)" + (" or auto" if auto else ""))
    if len(text.lstrip("+-").lstrip("0")) > 9:  # int() of 100 kB of digits: slow, refused
        number = -(10**9) if text.startswith("-") else 10**9
    else:
        number = int(text)
    if number < least:
        raise ValueError(f"must be {least} or more")
    if most is not None and number > most:
        raise ValueError(f"must be {most} or less")
    return number


def parse(line: str) -> tuple[Setting, ...]:
    """The settings of one line, in order; raises SettingsError listing every problem."""
    settings: list[Setting] = []
    problems: list[str] = []
    for item in (i.strip() for i in line.split(",")):
        if not item:
            continue
        key, sep, raw = item.partition("=")
        shown = repr(log_name(item))
        loader, dot, name = key.strip().rpartition(".")
        if not sep or not dot or not loader:
            problems.append(f"{shown}: expected LOADER.SETTING=VALUE (LOADER may be {ANY})")
            continue
        if loader != ANY and not _NAME.match(loader):
            problems.append(f"{shown}: {log_name(loader)!r} is not a loader name")
            continue
        if name not in SETTINGS:
            problems.append(f"{shown}: unknown setting {log_name(name)!r} (known: "
                            f"{', '.join(SETTINGS)})")
            continue
        kind, least = SETTINGS[name]
        try:
            settings.append(Setting(loader, name, _value(kind, least, MAXIMA.get(name), raw,
                                                          name in TUNABLE)))
        except ValueError as e:
            problems.append(f"{shown}: {name} {e}")
    seen: dict[tuple[str, str], Value] = {}
    for s in settings:
        if seen.setdefault((s.loader, s.name), s.value) != s.value:
            problems.append(f"{log_name(s.loader)}.{s.name} is given twice, with different "
                            "values")
    for loader in {s.loader for s in settings}:
        own = {s.name: s.value for s in settings if s.loader == loader}
        if own.get("num_workers") == 0:
            clash = [n for n in NEEDS_WORKERS if own.get(n) not in (None, False, AUTO)]
            if clash:
                problems.append(f"{log_name(loader)}: {' and '.join(clash)} need workers, but "
                                "num_workers=0")
    if problems:
        raise SettingsError(f"{ENV_SETTINGS}: " + "; ".join(problems))
    return tuple(settings)


def for_loader(settings: Iterable[Setting], loader: str) -> dict[str, Value]:
    """The settings that apply to one loader name: its own over those for every loader."""
    out: dict[str, Value] = {}
    own: dict[str, Value] = {}
    for s in settings:
        if s.loader == ANY:
            out[s.name] = s.value
        elif s.loader == loader:
            own[s.name] = s.value
    out.update(own)
    return out


def tuned(settings: Iterable[Setting], loader: str) -> tuple[str, ...]:
    """The settings of one loader name that the tuner sets (AUTO), in TUNABLE order."""
    wanted = for_loader(settings, loader)
    return tuple(name for name in TUNABLE if wanted.get(name) == AUTO)


def named_loaders(settings: Iterable[Setting]) -> set[str]:
    """The loader names a line mentions (to say which never matched a loader)."""
    return {s.loader for s in settings if s.loader != ANY}


def _text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def format_settings(loader: str, settings: Mapping[str, object]) -> str:
    """One loader's settings as a line of ENV_SETTINGS, in SETTINGS order.

    format_settings("train", {"num_workers": 8, "persistent_workers": True})
    == "train.num_workers=8,train.persistent_workers=true". Raises SettingsError for an
    unknown setting or value, so what the doctor prints always parses.
    """
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise SettingsError(f"unknown setting(s) {', '.join(unknown)} (known: "
                            f"{', '.join(SETTINGS)})")
    line = ",".join(f"{loader}.{name}={_text(settings[name])}" for name in SETTINGS
                    if name in settings)
    parse(line)
    return line
