"""A doctor window from a directory of snapshot files: the trainer's own, or a copy of a
pod's, while the run goes on or after it has ended.

The files are read by the sidecar's hardened reader (exporter.collectors.trainer): only
regular files, bounded, validated, taken whole or skipped whole, and per (loader, rank)
the newest file wins. Unlike the sidecar, the doctor never drops nor deletes a file for
its age (stale_after and remove_after are infinite): an ended run's files are exactly
what it was asked to read, and they are the user's.

A live writer rewrites its file every second, so a newest valid file younger than
LIVE_WITHIN means a live run: it is read twice, `interval` apart, like an exporter's
/metrics. Otherwise the run has ended (or the files are a copy) and one reading gives
the whole run (Window.whole_run).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest

from diagnosis.signals import Scrape, Window, window_of
from exporter import catalogue as cat
from exporter.collectors.trainer import SUFFIX, TrainerCollector

LIVE_WITHIN = 5.0  # seconds: a live writer rewrites its file every second
WHOLE_RUN = "rates per second of loop time"


class SnapshotDir:
    """Readings of one directory of snapshot files, and the files its reader skipped."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.collector = TrainerCollector(directory, stale_after=math.inf,
                                          remove_after=math.inf)
        self.registry = CollectorRegistry()
        self.registry.register(self.collector)

    def read(self) -> Scrape:
        """Every valid file's series as one scrape; OSError when the directory cannot be
        listed, ValueError when it holds no valid snapshot file."""
        try:
            with os.scandir(self.directory):
                pass
        except OSError as e:
            raise OSError(f"{self.directory}: {e.strerror or type(e).__name__}") from None
        with _quiet(logging.getLogger("exporter")):
            text = generate_latest(self.registry).decode()
        scrape = Scrape.parse(text)
        if self.age(scrape) is None:
            raise ValueError(self._nothing_valid())
        return scrape

    @staticmethod
    def age(scrape: Scrape) -> float | None:
        """Seconds since the newest valid file was written; None: no valid file."""
        return scrape.series.get((cat.SNAPSHOT_AGE.name, ()))

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
        return f"no snapshot file (*{SUFFIX}) in {self.directory}"


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
    age = snapshots.age(first)
    if age is None or age > LIVE_WITHIN:
        return (Window.whole_run(first),
                f"{where}, whole run (the files are no longer written): {WHOLE_RUN}")
    sleep(interval)
    w = window_of(first, snapshots.read())
    if w.is_whole_run:
        return w, (f"{where}, whole run (no batch in {interval:g} s between reads: the run "
                   f"has ended): {WHOLE_RUN}")
    return w, f"{where}, {interval:g} s between reads"
