"""A doctor window from a directory of snapshot files: the trainer's own, or a copy of a
pod's, while the run goes on or after it has ended.

The files are read by the sidecar's hardened reader (exporter.collectors.trainer): only
regular files, bounded, validated, taken whole or skipped whole, and per (loader, rank)
the newest file wins. Unlike the sidecar, the doctor never drops nor deletes a file for
its age (stale_after and remove_after are infinite): an ended run's files are exactly
what it was asked to read, and they are the user's.

A live writer rewrites its file every second, so a newest file younger than
LIVE_WITHIN means a live run: it is read twice, `interval` apart, like an exporter's
/metrics (a live run that hands out no batch is idle or stalled, never "ended"). Otherwise
the run has ended (or the files are a copy) and one reading gives the whole run
(Window.whole_run).

One run's files are those written within RUN_SPAN of the newest: a file older than that
is an earlier run's (a restart, or last week's job in the same volume), and is left out,
said on stderr. The ranks a host's files hold share its machine (the host is in each
file's name): that is each rank's count of local ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import stat
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.diagnosis.signals import Scrape, Window, window_of
from dataloader_exporter.exporter.collectors import snapshot
from dataloader_exporter.exporter.collectors.trainer import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_SERIES,
    DEFAULT_STALE_AFTER,
    TrainerCollector,
)

LIVE_WITHIN = 5.0  # seconds: a live writer rewrites its file every second
RUN_SPAN = DEFAULT_STALE_AFTER  # what the sidecar counts as one run's files, too
WHOLE_RUN = "rates per second of loop time"


def ended(scrape: Scrape) -> bool:
    """Whether a sidecar's scrape says its trainers stopped writing (the newest snapshot
    file is older than LIVE_WITHIN); False when it does not say (an in-process server)."""
    age = scrape.series.get((cat.SNAPSHOT_AGE.name, ()))
    return age is not None and age > LIVE_WITHIN


class SnapshotDir:
    """Readings of one directory of snapshot files, and the files its reader skipped."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.newest: float | None = None  # mtime of the newest *.prom regular file
        # As the sidecar reads them, at the time of the newest file: older than RUN_SPAN
        # before it is another run's. Nothing is ever deleted.
        self.collector = TrainerCollector(directory, stale_after=RUN_SPAN,
                                          remove_after=math.inf,
                                          clock=lambda: self.newest or 0.0)
        self.registry = CollectorRegistry()
        self.registry.register(self.collector)
        self.earlier = 0  # files left out as an earlier run's
        self._runs_files: list[tuple[str, float, set[str]]] = []

    def _valid(self) -> list[tuple[str, float, set[str]]]:
        """(name, mtime, ranks) of each valid snapshot file (OSError if unlistable)."""
        try:
            with os.scandir(self.directory) as it:
                entries = list(it)
        except OSError as e:
            raise OSError(f"{self.directory}: {e.strerror or type(e).__name__}") from None
        out = []
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
                if not (entry.name.endswith(snapshot.SUFFIX) and stat.S_ISREG(st.st_mode)):
                    continue
                data, _ = snapshot.read(entry.path, DEFAULT_MAX_FILE_BYTES)
                owners = snapshot.load(data, DEFAULT_MAX_SERIES).owners
            except (OSError, snapshot.Rejected):
                continue  # the reader below counts and says what it skips
            out.append((entry.name, st.st_mtime, {rank for _, rank in owners}))
        return out

    @property
    def age(self) -> float | None:
        """Seconds since the newest file was written, as of the last read."""
        return None if self.newest is None else max(0.0, time.time() - self.newest)

    def local_ranks(self) -> dict[str, int]:
        """rank -> the ranks its host's files hold (a host's ranks share its machine)."""
        hosts: dict[str, set[str]] = {}
        for name, mtime, ranks in self._runs_files:
            if self.newest is not None and mtime >= self.newest - RUN_SPAN:
                hosts.setdefault(name.rsplit("-", 2)[0], set()).update(ranks)
        return {rank: len(ranks) for ranks in hosts.values() for rank in ranks}

    def read(self) -> Scrape:
        """Every valid file's series as one scrape; OSError when the directory cannot be
        listed, ValueError when it holds no valid snapshot file."""
        self._runs_files = self._valid()
        self.newest = max((m for _, m, _ in self._runs_files), default=None)
        with _quiet(logging.getLogger("dataloader_exporter.exporter")):
            text = generate_latest(self.registry).decode()
        scrape = Scrape.parse(text)
        self.earlier = int(scrape.series.get(
            (cat.SNAPSHOT_FILES.name, (("state", "stale"),)), 0))
        if scrape.series.get((cat.SNAPSHOT_AGE.name, ())) is None:
            raise ValueError(self._nothing_valid())
        return scrape

    @property
    def skipped(self) -> dict[str, int]:
        """Files the reader skipped whole (corrupt, too big, not regular...), by reason."""
        return {reason: n for reason, n in self.collector.rejected.items() if n}

    def describe_skipped(self) -> str:
        """'2 files in DIR that are not valid snapshots (malformed 1, too_large 1)'."""
        n = sum(self.skipped.values())
        reasons = ", ".join(f"{reason} {count}" if n > 1 else reason
                            for reason, count in sorted(self.skipped.items()))
        if n == 1:
            return f"1 file in {self.directory} that is not a valid snapshot ({reasons})"
        return f"{n} files in {self.directory} that are not valid snapshots ({reasons})"

    def _nothing_valid(self) -> str:
        if self.skipped:
            return f"no valid snapshot file: skipped {self.describe_skipped()}"
        return f"no snapshot file (*{snapshot.SUFFIX}) in {self.directory}"


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    """Holds back the reader's log lines (a sidecar's, one per skipped file): the doctor
    says what it skipped once, in its own words."""
    def drop(record: logging.LogRecord) -> bool:
        return False

    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def window(snapshots: SnapshotDir, interval: float,
           sleep: Callable[[float], None] = time.sleep) -> tuple[Window, str]:
    """The window to diagnose and the source line that says what it is: two readings
    `interval` apart while the files are written, else the whole run from one."""
    where = snapshots.directory
    first = snapshots.read()
    age = snapshots.age
    if age is None or age > LIVE_WITHIN:
        w, source = Window.whole_run(first), (
            f"{where}, whole run (the files are no longer written): {WHOLE_RUN}")
    else:
        sleep(interval)
        second = snapshots.read()
        w = window_of(first, second, (snapshots.age or 0.0) > LIVE_WITHIN)
        source = (f"{where}, whole run (no batch in {interval:g} s between reads: the run "
                  f"has ended): {WHOLE_RUN}" if w.is_whole_run else
                  f"{where}, {interval:g} s between reads")
    return dataclasses.replace(w, local_ranks=snapshots.local_ranks() or None), source
