"""A fast, strict parser for the text exposition format that trainers' snapshots use.

prometheus_client's parser is general and slow (about 15 us a line, so 8 ranks x 4
loaders took ~50 ms a scrape: bench/scrape.py). Snapshot files are written by
prometheus_client itself, so this parser handles exactly that format (# HELP, # TYPE,
`name{labels} value [timestamp]` lines, escaped label values) with a C regex per line,
and raises ValueError on anything else, so a torn or foreign file is skipped, not guessed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)')
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("_sum", "_count", "_created", ""),
             "counter": ("_total", "_created"), "gauge": ("",), "untyped": ("",),
             "unknown": ("",), "info": ("_info",), "stateset": ("",), "gaugehistogram":
             ("_bucket", "_gsum", "_gcount")}
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass
class ParsedFamily:
    name: str  # counters without _total, as prometheus_client names families
    type: str = "untyped"
    help: str = ""
    samples: list[tuple[str, tuple[tuple[str, str], ...], float]] = field(default_factory=list)
    raw: str = ""  # the name as written in # HELP / # TYPE


def _unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return re.sub(r'\\[\\"n]', lambda m: _ESCAPES[m.group(0)], value)


_label_cache: dict[str, tuple[tuple[str, str], ...]] = {}
_good_names: set[str] = set()
_CACHE_MAX = 200_000  # label strings repeat from one snapshot write to the next


def _labels(text: str) -> tuple[tuple[str, str], ...]:
    cached = _label_cache.get(text)
    if cached is not None:
        return cached
    if len(_label_cache) >= _CACHE_MAX:
        _label_cache.clear()
        _good_names.clear()
    parsed = _label_cache[text] = _parse_labels(text)
    return parsed


def _parse_labels(text: str) -> tuple[tuple[str, str], ...]:
    if not text:
        return ()
    out = []
    pos = 0
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if m is None:
            raise ValueError(f"bad labels {text!r}")
        out.append((m.group(1), _unescape(m.group(2))))
        pos = m.end()
    return tuple(sorted(out))


def _value(text: str) -> float:
    try:
        return float(text)  # the usual case: " 12.0" (float() strips spaces)
    except ValueError:
        pass
    parts = text.split()
    if not 1 <= len(parts) <= 2:
        raise ValueError(f"bad value {text!r}")
    v = float(parts[0])  # accepts NaN, +Inf, -Inf
    if len(parts) == 2:
        float(parts[1])  # a timestamp: checked, then ignored
    return v if not math.isnan(v) else math.nan


def _family_for(name: str, current: ParsedFamily | None) -> bool:
    if current is None:
        return False
    base = current.name + ("_total" if current.type == "counter" else "")
    if current.type == "counter":
        return name in (base, current.name + "_created")
    return any(name == current.name + s for s in _SUFFIXES.get(current.type, ("",)))


def parse(text: str) -> list[ParsedFamily]:
    """Families in file order; ValueError on a malformed line."""
    families: list[ParsedFamily] = []
    current: ParsedFamily | None = None
    for line in text.split("\n"):
        if not line:
            continue
        if line[0] == "#":
            parts = line.split(" ", 3)
            if len(parts) < 3 or parts[1] not in ("HELP", "TYPE"):
                continue  # a comment
            raw = parts[2]
            if not _NAME.match(raw):
                raise ValueError(f"bad metric name {raw!r}")
            rest = parts[3] if len(parts) > 3 else ""
            if current is None or current.samples or current.raw != raw:
                current = ParsedFamily(raw, raw=raw)
                families.append(current)
            if parts[1] == "TYPE":
                if rest not in _SUFFIXES:
                    raise ValueError(f"unknown type {rest!r}")
                current.type = rest
                if rest == "counter" and raw.endswith("_total"):
                    current.name = raw[: -len("_total")]
            else:
                current.help = _unescape(rest)
            continue
        brace = line.find("{")
        if brace >= 0:
            close = line.rfind("}")
            if close < brace:
                raise ValueError(f"unclosed labels in {line[:80]!r}")
            name, labels, value = line[:brace], _labels(line[brace + 1:close]), line[close + 1:]
        else:
            name, _, value = line.partition(" ")
            labels = ()
        if name not in _good_names:
            if not _NAME.match(name):
                raise ValueError(f"bad sample name {name!r}")
            _good_names.add(name)
        if not _family_for(name, current):
            current = ParsedFamily(name, raw=name)
            families.append(current)
        assert current is not None
        current.samples.append((name, labels, _value(value)))
    return families
