"""The trainer collector: merges the snapshot files trainers write into one scrape.

Each trainer process rewrites ``<dir>/<host>-<pid>-<token>.prom`` about every second
(atomically: write, then rename). At each scrape this collector reads every ``*.prom``
file, drops the stale ones (not rewritten for ``stale_after`` seconds: the writer is gone
or hung) without parsing them, and merges the rest. When a trainer restarts, its new
file and the old one both hold series for the same (loader, rank) until the old one goes
stale; the newest file wins, so nothing is counted twice. A torn or malformed file is
skipped and counted; it never fails the scrape.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric as Family

from exporter import catalogue as cat

from .base import LogOnce, family
from .textparse import ParsedFamily, parse

log = logging.getLogger("exporter")

SUFFIX = ".prom"
# Families the exporter produces itself; a trainer file serving them in-process too
# must not duplicate them.
_OWN = frozenset(m.family for m in cat.ALL if m.source != cat.TRAINER)


@dataclass
class _Merged:
    type: str
    help: str
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)


class TrainerCollector:
    """Trainer metrics from the snapshot files of a directory."""

    name = cat.TRAINER

    def __init__(self, directory: str, stale_after: float = 30.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.directory = directory
        self.stale_after = stale_after
        self.clock = clock
        self.up = True
        self.errors = 0
        self._log = LogOnce(log)
        # Parsed files by path, reused while (mtime, size, inode) stay the same: several
        # scrapers (Prometheus replicas, doctor, top) within one write period parse once.
        self._cache: dict[str, tuple[tuple[int, int, int], list[ParsedFamily]]] = {}

    def collect(self) -> Iterator[Family]:
        now = self.clock()
        fresh, stale = self._scan(now)
        merged: dict[str, _Merged] = {}
        claimed: set[tuple[str, str]] = set()  # (loader, rank) pairs of newer files
        newest = None
        cache: dict[str, tuple[tuple[int, int, int], list[ParsedFamily]]] = {}
        for mtime, path, stamp in sorted(fresh, reverse=True):
            hit = self._cache.get(path)
            if hit is not None and hit[0] == stamp:
                parsed: list[ParsedFamily] | None = hit[1]
            else:
                text = self._read(path)
                parsed = None if text is None else self._parse(path, text)
            if parsed is None:
                continue
            cache[path] = (stamp, parsed)
            newest = mtime if newest is None else max(newest, mtime)
            owners = _merge(parsed, merged, claimed)
            claimed |= owners
        self._cache = cache  # only files still present and fresh stay cached
        yield from _families(merged)
        files = family(cat.SNAPSHOT_FILES)
        files.add_metric(["fresh"], len(fresh))
        files.add_metric(["stale"], stale)
        yield files
        if newest is not None:
            age = family(cat.SNAPSHOT_AGE)
            age.add_metric([], max(0.0, now - newest))
            yield age

    def _scan(self, now: float) -> tuple[list[tuple[float, str, tuple[int, int, int]]], int]:
        try:
            entries = list(os.scandir(self.directory))
        except OSError as e:
            self.up = False
            self.errors += 1
            self._log.problem("dir", "cannot read metrics directory %s: %s", self.directory, e)
            return [], 0
        self.up = True
        self._log.cleared("dir", "metrics directory %s is readable again", self.directory)
        fresh, stale = [], 0
        for entry in entries:
            if not entry.name.endswith(SUFFIX):
                continue  # temporary files of writers mid-write, anything else
            try:
                st = entry.stat()
            except OSError:  # vanished since the listing: not an error
                continue
            if now - st.st_mtime > self.stale_after:
                stale += 1
            else:
                fresh.append((st.st_mtime, entry.path, (st.st_mtime_ns, st.st_size, st.st_ino)))
        return fresh, stale

    def _read(self, path: str) -> str | None:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as e:
            self._error(path, e)
            return None

    def _parse(self, path: str, text: str) -> list[ParsedFamily] | None:
        if text and not text.endswith("\n"):
            self._error(path, ValueError("truncated (no final newline)"))
            return None
        try:
            return parse(text)
        except ValueError as e:
            self._error(path, e)
            return None

    def _error(self, path: str, e: Exception) -> None:
        self.errors += 1
        self._log.problem(f"file:{os.path.basename(path)}", "skipping snapshot %s: %s", path, e)


def _owner(labels: tuple[tuple[str, str], ...]) -> tuple[str, str] | None:
    loader = rank = None
    for k, v in labels:
        if k == "loader":
            loader = v
        elif k == "rank":
            rank = v
    return (loader, rank) if loader is not None and rank is not None else None


def _merge(parsed: list[ParsedFamily], merged: dict[str, _Merged],
           claimed: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """Adds one file's samples unless a newer file already has them; returns its owners."""
    owners: set[tuple[str, str]] = set()
    for fam in parsed:
        if fam.name in _OWN:
            continue
        slot = merged.get(fam.name)
        if slot is None:
            slot = merged[fam.name] = _Merged(fam.type, fam.help)
        elif slot.type != fam.type:
            continue
        samples = slot.samples
        for name, labels, value in fam.samples:
            owner = _owner(labels)
            if owner is not None:
                if owner in claimed:
                    continue
                owners.add(owner)
            samples.setdefault((name, labels), value)
    return owners


def _families(merged: dict[str, _Merged]) -> Iterator[Family]:
    for name, m in merged.items():
        if not m.samples:
            continue
        fam = Family(name, m.help, m.type)
        for (sample, labels), value in m.samples.items():
            fam.add_sample(sample, dict(labels), value)
        yield fam
