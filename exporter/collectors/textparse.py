"""A fast, strict parser for the text format that trainers' snapshot files use.

prometheus_client's parser is general, lax and too slow to run over every rank's file
each scrape (docs/design/exporter.md). Snapshot files are written by prometheus_client's
text encoder over instrument's collector, so this parser accepts exactly that shape and
nothing more: per family a ``# HELP`` line, a ``# TYPE`` line and
its samples, each ``name{label="value",...} number`` with no timestamp, label values
escaped as the encoder escapes them (and free of other control characters), and a
newline after every line. One C regex pass reads the whole file; a line it cannot match
makes the whole file a ValueError. Which families, labels and values are allowed is
snapshot.py's business.

Error messages hold line numbers and fixed text only, never the file's content: the
file may be anything (a symlink to a secret, another program's output) and messages end
up in logs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple

Labels = tuple[tuple[str, str], ...]  # sorted by label name


class LabelSet(NamedTuple):
    """The labels of a sample, in the forms validation and exposition need.

    Shared by every sample written with the same label text (and cached across files
    and scrapes), so ``mapping`` must be treated as read-only.
    """

    pairs: Labels
    names: tuple[str, ...]
    mapping: dict[str, str]  # a bucket line's (le first): the rest's, without le
    le: str  # the value of an le label, "" if none
    rest: Labels  # the pairs without le
    text: str  # as the encoders write them: sorted, escaped, in braces ("" for none)


NO_LABELS = LabelSet((), (), {}, "", (), "")

# Possessive quantifiers and atomic groups throughout: a line that fails must fail in
# time linear in its length (a backtracking "[0-9]+\.?[0-9]*" took 5 s on 16,000 digits).
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*+"
# Label values: any character but quote, backslash and control characters, or one of
# the three escapes the encoder writes (unrolled: a third faster than an alternation).
_VALUE = r'[^"\\\x00-\x1f\x7f]*+(?:\\[\\"n][^"\\\x00-\x1f\x7f]*+)*+'
_PAIR = rf'[a-zA-Z_][a-zA-Z0-9_]*+="{_VALUE}"'
# What float() reads back from Go-style formatting: no underscores, no "infinity".
_NUMBER = r"(?>[-+]?(?:[0-9]++(?:\.[0-9]*+)?|\.[0-9]++)(?:[eE][-+]?[0-9]++)?|[-+]Inf|NaN)"
# Label text is matched loosely here (a third faster; up to the last "}" that a number
# follows) and strictly, by _LABEL_TEXT, the first time each distinct text is seen: only
# label texts that passed are cached.
_LINE = re.compile(
    rf"^(?:# (HELP|TYPE) ({_NAME})(?: ([^\n]*+))?"
    rf"|({_NAME})(?:\{{([^\n}}]*+(?:\}}[^\n}}]*+)*?)\}})? ({_NUMBER}))\n", re.M)
_LABEL_TEXT = re.compile(rf"{_PAIR}(?:,{_PAIR})*+")
_PAIRS = re.compile(rf'([a-zA-Z_][a-zA-Z0-9_]*+)="({_VALUE})"')
_ESCAPE = re.compile(r'\\[\\"n]')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
# Sample names each type allows, as suffixes of the name in # TYPE (which, for counters,
# prometheus_client writes with _total, so a counter's samples take no suffix).
_SUFFIXES = {"counter": ("",), "gauge": ("",), "untyped": ("",),
             "histogram": ("_bucket", "_count", "_sum"), "summary": ("", "_count", "_sum")}


@dataclass
class ParsedFamily:
    """One family as written: the name of its # TYPE line, its type and samples."""

    name: str
    type: str
    samples: list[tuple[str, LabelSet, float]] = field(default_factory=list)


# Label texts repeat from one write of a file to the next: 32 ranks of 4 loaders (12,646
# series) have 641 distinct ones once bucket lines share theirs (_bucket), about 1.2 kB
# each here. Bounded in entries and in the length of the texts it keeps (at most ~12 MB);
# when full it starts afresh.
_label_cache: dict[str, LabelSet] = {"": NO_LABELS}
_names: dict[tuple[str, ...], tuple[str, ...]] = {}  # a few distinct tuples, shared
_CACHE_MAX = 8_192
_CACHE_KEY_MAX = 256


def _unescape(value: str) -> str:
    return _ESCAPE.sub(lambda m: _ESCAPES[m.group(0)], value) if "\\" in value else value


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(text: str) -> LabelSet | None:
    """The labels of a label text, None if it is not one the encoder writes."""
    if _LABEL_TEXT.fullmatch(text) is None:
        return None
    pairs = tuple(sorted((k, _unescape(v)) for k, v in _PAIRS.findall(text)))
    mapping = dict(pairs)
    names = tuple(k for k, _ in pairs)
    names = _names.setdefault(names, names) if len(_names) < 1000 else names
    le = mapping.get("le", "")
    encoded = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
    labels = LabelSet(pairs, names, mapping, le,
                      tuple(p for p in pairs if p[0] != "le") if le else pairs,
                      "{" + encoded + "}" if pairs else "")
    if len(text) <= _CACHE_KEY_MAX:
        if len(_label_cache) >= _CACHE_MAX:
            _label_cache.clear()
            _label_cache[""] = NO_LABELS
        _label_cache[text] = labels
    return labels


_LE = re.compile(r"[-+0-9.eE]++|\+Inf")
_le_names: dict[tuple[str, ...], tuple[str, ...]] = {}
_le_ok: set[str] = set()  # le values that matched _LE: a histogram's few bounds
_new = tuple.__new__  # LabelSet(...) without its Python-level __new__: twice as fast


def _bucket(text: str) -> LabelSet | None:
    """The labels of a bucket line, `le="..."` first as the encoder sorts it: only the
    rest is cached (a histogram's 20 buckets share it), which keeps the cache a tenth
    of the size at 32 ranks x 4 loaders (about 9 MB less). Anything else: _labels()."""
    end = text.find('"', 4)
    le = text[4:end]
    rest_text = text[end + 2:] if text[end + 1:end + 2] == "," else None
    if end < 0 or rest_text is None:
        return _label_cache.get(text) or _labels(text)
    if le not in _le_ok:
        if _LE.fullmatch(le) is None:
            return _label_cache.get(text) or _labels(text)
        if len(_le_ok) < 1000:
            _le_ok.add(le)
    rest = _label_cache.get(rest_text) or _labels(rest_text)
    if rest is None or not rest.names or rest.names[0] <= "le":
        return _label_cache.get(text) or _labels(text)
    names = _le_names.get(rest.names)
    if names is None:
        names = ("le", *rest.names)
        if len(_le_names) < 1000:
            _le_names[rest.names] = names
    # mapping: the rest's (shared), without le. Bucket samples are validated and written
    # from pairs, le and text; nothing builds a Sample from a bucket's mapping.
    return _new(LabelSet, ((("le", le), *rest.pairs), names, rest.mapping, le, rest.pairs,
                           '{le="' + le + '",' + rest.text[1:]))


def first_bad_line(text: str) -> int:
    """The number (from 1) of the first line the format does not allow, else 0."""
    lines = text.split("\n")
    for number, line in enumerate(lines[:-1], 1):
        if _LINE.fullmatch(line + "\n") is None:
            return number
    return len(lines) if lines[-1] else 0  # text after the last newline: cut short


def parse(text: str) -> list[ParsedFamily]:
    """Families in file order; ValueError (line number, no content) if the text is not
    exactly the format prometheus_client's text encoder writes."""
    found = _LINE.findall(text)
    if len(found) != text.count("\n") or (text and text[-1] != "\n"):
        raise ValueError(f"line {first_bad_line(text)}: not the text exposition format")
    families: list[ParsedFamily] = []
    seen: set[str] = set()  # family names: each may appear once
    help_name = ""  # the name of a # HELP line waiting for its # TYPE
    allowed: frozenset[str] = frozenset()  # sample names of the current family
    samples: list[tuple[str, LabelSet, float]] = []  # of the current family
    append = samples.append
    cached = _label_cache.get
    for number, (kind, meta, rest, name, labels, value) in enumerate(found, 1):
        if not kind:  # a sample line, by far the most common
            if name not in allowed:
                raise ValueError(f"line {number}: sample outside its family")
            if labels.startswith('le="'):
                label_set = _bucket(labels)
            else:
                label_set = cached(labels) or _labels(labels)
            if label_set is None:
                raise ValueError(f"line {number}: labels not in the text format")
            append((name, label_set, float(value)))  # _NUMBER: float() cannot fail
        elif kind == "HELP":
            if help_name or meta in seen:
                raise ValueError(f"line {number}: HELP out of place")
            help_name, allowed = meta, frozenset()
        else:  # TYPE
            if meta != help_name or rest not in _SUFFIXES:
                raise ValueError(f"line {number}: TYPE without its HELP, or an unknown type")
            help_name = ""
            seen.add(meta)
            family = ParsedFamily(meta, rest)
            families.append(family)
            append = family.samples.append
            allowed = _allowed(meta, rest)
    if help_name:
        raise ValueError("HELP without TYPE at the end")
    return families


_allowed_cache: dict[tuple[str, str], frozenset[str]] = {}


def _allowed(name: str, type_: str) -> frozenset[str]:
    key = (name, type_)
    names = _allowed_cache.get(key)
    if names is None:
        names = frozenset(name + s for s in _SUFFIXES[type_])
        if len(_allowed_cache) < 1000:  # the catalogue has a few dozen names
            _allowed_cache[key] = names
    return names
