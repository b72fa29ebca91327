"""The trainer collector: the snapshot files trainers write, merged into one scrape.

Each trainer process rewrites ``<dir>/<host>-<pid>-<token>.prom`` about every second,
atomically. Each scrape lists the directory once and hands the listing to a
SnapshotRetention (exporter.snapshot_retention), which deletes old files. Of the rest:

- only regular files are read: a symbolic link (even to a file inside the directory),
  FIFO, socket, device or directory is never opened, and counts as ``not_regular``;
- a file not rewritten for ``stale_after`` seconds is dropped unread (counted as stale);
- each version of a file (inode, mtime, size) is read and validated (collectors.snapshot)
  once: taken whole, or rejected whole, counted in ``snapshot_errors_total{reason}`` and
  logged once per file and reason (more than LOG_EACH files in one scrape share a line);
- a file caught mid-rewrite by a writer that rewrites it in place is served as its last
  whole version, uncounted, and read again at the next scrape: one found empty for less
  than EMPTY_GRACE, or one rejected by two reads that found different bytes;
- a rejection is remembered by reason and detail only, never the exception caught (whose
  traceback holds the parsed file) nor the bytes.

Per (loader, rank) the newest file wins, so a restarted trainer's old and new files are
not counted twice, and a rejected file never affects another file's series; a process's
series (the exit time, one per rank) are the newest file's that names its rank.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import NamedTuple

from prometheus_client.metrics_core import Metric as Family

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.core.logonce import LogOnce
from dataloader_exporter.exporter.exposition import EncodedFamily
from dataloader_exporter.exporter.snapshot_retention import (
    KEEP_FAILED_FOR,
    SnapshotRetention,
    default_remove_after,
)

from . import snapshot
from .base import family
from .snapshot import SUFFIX, Owner, Rejected, Snapshot, Stamp

log = logging.getLogger("dataloader_exporter.exporter")

DEFAULT_STALE_AFTER = 30.0
# About 20 times a real snapshot of 8 loaders of 16 workers (98 kB, 1,144 series); a file
# near the bounds takes about 55 ms to parse and validate, once per version.
DEFAULT_MAX_FILE_BYTES = 2 * 1024 * 1024
DEFAULT_MAX_SERIES = 20_000
_TRAINER = tuple(m for m in cat.ALL if m.source == cat.TRAINER)

# Up to this many files rejected (or valid again) in one scrape are logged one line
# each; more share one line.
LOG_EACH = 3

# An empty file counts as invalid once it has stayed so this long (seconds): a writer
# that truncates its file and then writes it leaves it empty for milliseconds.
EMPTY_GRACE = 1.0

# A verdict on one version of a file: its samples, or why it was rejected.
_Verdict = tuple[Stamp, Snapshot | Rejected]
_EMPTY = Rejected(snapshot.INVALID, "empty")


class _Read(NamedTuple):
    """One read of a file: the version read, its bytes (None if refused before reading)
    and its verdict."""

    stamp: Stamp
    data: bytes | None
    result: Snapshot | Rejected


class TrainerCollector:
    """Trainer metrics from the snapshot files of a directory."""

    name = cat.TRAINER

    def __init__(self, directory: str, stale_after: float = DEFAULT_STALE_AFTER,
                 clock: Callable[[], float] = time.time,
                 max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 max_series: int = DEFAULT_MAX_SERIES,
                 remove_after: float | None = None,
                 read: Callable[[str, int], tuple[bytes, Stamp]] = snapshot.read,
                 keep_failed_for: float = KEEP_FAILED_FOR) -> None:
        """remove_after and keep_failed_for: the SnapshotRetention's (None:
        default_remove_after(stale_after); math.inf: never delete). read: snapshot.read, or
        a fake that tears reads for tests."""
        if remove_after is None:
            remove_after = default_remove_after(stale_after)
        if remove_after < stale_after:
            raise ValueError("remove_after must not be shorter than stale_after")
        self.directory = directory
        self.stale_after = stale_after
        self.clock = clock
        self.max_file_bytes = max_file_bytes
        self.max_series = max_series
        self.read = read
        self.retention = SnapshotRetention(directory, remove_after, read, max_file_bytes,
                                           max_series, keep_failed_for)
        self.up = True
        self.errors = 0
        self.rejected = dict.fromkeys(snapshot.REASONS, 0)  # files skipped, once per reason
        self._log = LogOnce(log)
        self._lock = threading.Lock()  # a warm-up collection may overlap a scrape
        # Verdicts by path, only for entries present (and, if regular, fresh).
        self._verdicts: dict[str, _Verdict] = {}
        # The last whole version of each fresh file, served while a read finds it torn or
        # emptied by an in-place writer (a moment older than the file, not nothing).
        self._last_whole: dict[str, Snapshot] = {}
        self._bad: dict[str, str] = {}  # path -> the reason it was counted and logged for
        self._news: list[tuple[str, str, str]] = []  # this scrape's: (name, reason, detail)
        self._valid_again: list[str] = []  # this scrape's names

    @property
    def remove_after(self) -> float:
        return self.retention.remove_after

    @property
    def keep_failed_for(self) -> float:
        return self.retention.keep_failed_for

    @property
    def _failed(self) -> dict[str, tuple[Stamp, float]]:
        """The last snapshots of runs that ended badly, kept past remove_after."""
        return self.retention.failed

    def collect(self) -> Iterator[Family]:
        with self._lock:
            families = self._collect()
        yield from families

    def _collect(self) -> list[Family]:
        now = self.clock()
        entries = self._list()
        if entries is None:  # unreadable for now: keep what is known of the files
            return [self._errors()]
        removed = self.retention.sweep(entries, now)
        fresh, stale = self._classify([e for e in entries if e.path not in removed], now)
        merged: dict[str, list[str]] = {m.name: [] for m in _TRAINER}
        claimed: set[Owner] = set()  # (loader, rank) pairs of newer files
        ranks: set[str] = set()  # and their ranks
        newest = None
        for mtime, name, path, stamp in sorted(fresh, key=lambda f: (f[0], f[1]), reverse=True):
            verdict = self._verdict(name, path, stamp)
            if isinstance(verdict, Snapshot):
                newest = mtime if newest is None else max(newest, mtime)
                _merge(verdict, merged, claimed, ranks)
        present = self._verdicts.keys() | {f[2] for f in fresh}
        self._bad = {p: r for p, r in self._bad.items() if p in present}
        self._report()
        out = [_family(m, merged[m.name]) for m in _TRAINER if merged[m.name]]
        files = family(cat.SNAPSHOT_FILES)
        files.add_metric(["fresh"], len(fresh))
        files.add_metric(["stale"], stale)
        out += [files, self._errors()]
        if newest is not None:
            age = family(cat.SNAPSHOT_AGE)
            age.add_metric([], max(0.0, now - newest))
            out.append(age)
        return out

    def _errors(self) -> Family:
        errors = family(cat.SNAPSHOT_ERRORS)
        for reason, n in self.rejected.items():
            errors.add_metric([reason], n)
        return errors

    def _list(self) -> list[os.DirEntry[str]] | None:
        try:
            with os.scandir(self.directory) as it:
                entries = list(it)
        except OSError as e:
            self.up = False
            self.errors += 1
            self._log.problem("dir", "cannot read metrics directory %s: %s", self.directory,
                              e.strerror or type(e).__name__)
            return None
        self.up = True
        self._log.cleared("dir", "metrics directory %s is readable again", self.directory)
        return entries

    def _classify(self, entries: list[os.DirEntry[str]], now: float
                  ) -> tuple[list[tuple[float, str, str, Stamp]], int]:
        """Fresh regular files to read and the number of stale ones; rejects entries that
        are not regular files, forgets verdicts on files gone."""
        verdicts, self._verdicts = self._verdicts, {}
        fresh, stale = [], 0
        present = {entry.path for entry in entries}
        self._last_whole = {p: v for p, v in self._last_whole.items() if p in present}
        for entry in entries:
            name = entry.name
            if not name.endswith(SUFFIX):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:  # vanished since the listing: not an error
                continue
            stamp, regular = snapshot.stamp_of(st), stat.S_ISREG(st.st_mode)
            if regular and now - st.st_mtime > self.stale_after:
                stale += 1
                continue
            old = verdicts.get(entry.path)
            if old is not None and old[0] == stamp:
                self._verdicts[entry.path] = old  # unchanged: neither read nor counted again
            elif not regular:
                kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
                self._keep(name, entry.path, stamp, Rejected(snapshot.NOT_REGULAR, kind))
            if regular:
                fresh.append((st.st_mtime, name, entry.path, stamp))
        return fresh, stale

    def _verdict(self, name: str, path: str, stamp: Stamp) -> Snapshot | Rejected | None:
        """The verdict on a fresh file, read and validated unless unchanged; None if gone,
        or caught mid-write (read again at the next scrape)."""
        known = self._verdicts.get(path)
        if known is not None and known[0] == stamp:
            verdict = known[1]
        else:
            read = self._read(path, stamp)
            if read is not None and read.data is not None and not isinstance(read.result,
                                                                              Snapshot):
                again = self._read(path, stamp, read)
                if again is None:
                    return None  # gone
                if again is not read and not isinstance(again.result, Snapshot):
                    return self._last_whole.get(path)  # torn: read again at the next scrape
                read = again
            if read is None:
                return None
            self._keep(name, path, read.stamp, read.result)
            verdict, stamp = read.result, read.stamp
        if verdict is _EMPTY:
            if self.clock() - stamp[1] / 1e9 >= EMPTY_GRACE:
                self._count(name, path, _EMPTY)
            else:
                return self._last_whole.get(path)  # emptied to be written: its last version
        return verdict

    def _read(self, path: str, stamp: Stamp, earlier: _Read | None = None) -> _Read | None:
        """One read of a file and its verdict, None if it is gone; the same bytes as an
        earlier read's keep that read's verdict without being validated again.

        A Rejected caught is never kept, only its reason and detail: its traceback holds
        the reader's or the validator's frames, and with them the file's bytes or samples.
        """
        try:
            data, stamp = self.read(path, self.max_file_bytes)
        except FileNotFoundError:
            return None
        except Rejected as e:
            return _Read(stamp, None, Rejected(e.reason, e.detail))
        if earlier is not None and data == earlier.data:
            return earlier
        if not data:
            return _Read(stamp, data, _EMPTY)
        try:
            return _Read(stamp, data, snapshot.load(data, self.max_series))
        except Rejected as e:
            return _Read(stamp, data, Rejected(e.reason, e.detail))
        except Exception as e:  # a bug here must cost one file, not the scrape
            return _Read(stamp, data, Rejected(snapshot.INVALID,
                                               f"validation failed ({type(e).__name__})"))

    def _keep(self, name: str, path: str, stamp: Stamp, verdict: Snapshot | Rejected) -> None:
        """Records a verdict on a version of a file; counts a rejection (an empty file's
        is counted by _verdict, once it has stayed empty)."""
        self._verdicts[path] = (stamp, verdict)
        if isinstance(verdict, Snapshot):
            self._last_whole[path] = verdict
            if self._bad.pop(path, None) is not None:
                self._valid_again.append(name)
        elif verdict is not _EMPTY:
            self._last_whole.pop(path, None)  # bad, not torn: nothing of it is served
            self._count(name, path, verdict)

    def _count(self, name: str, path: str, rejected: Rejected) -> None:
        """Counts a rejection once per file and reason (a bad file rewritten every second
        counts once while it stays bad for the same reason); queues it for the log."""
        if self._bad.get(path) != rejected.reason:
            self._bad[path] = rejected.reason
            self.rejected[rejected.reason] += 1
            self.errors += 1
            self._news.append((name, rejected.reason, rejected.detail))

    def _report(self) -> None:
        """Logs this scrape's newly rejected files and those valid again: one line each
        for up to LOG_EACH, else one line for all, with a few names."""
        news, self._news = sorted(self._news), []
        good, self._valid_again = sorted(self._valid_again), []
        if len(news) > LOG_EACH:
            counts = Counter(reason for _, reason, _ in news)
            log.warning("skipping %d snapshots in %s (%s), among them %s", len(news),
                        self.directory, ", ".join(f"{n} {r}" for r, n in sorted(counts.items())),
                        ", ".join(f"{n!a} ({r}: {d})" for n, r, d in news[:LOG_EACH]))
        else:
            for name, reason, detail in news:
                log.warning("skipping snapshot %a in %s: %s (%s)", name, self.directory,
                            reason, detail)
        if len(good) > LOG_EACH:
            log.info("%d snapshots in %s are valid again, among them %s", len(good),
                     self.directory, ", ".join(ascii(n) for n in good[:LOG_EACH]))
        else:
            for name in good:
                log.info("snapshot %a is valid again", name)


def _merge(snap: Snapshot, merged: dict[str, list[str]], claimed: set[Owner],
           ranks: set[str]) -> None:
    """Adds one file's series unless a newer file has their (loader, rank), or for its
    process's series their rank; then claims its own."""
    for owner, by_family in snap.owners.items():
        if owner not in claimed:
            for name, chunk in by_family.items():
                merged[name].append(chunk)
    for rank, by_family in snap.ranks.items():
        if rank not in ranks:
            for name, chunk in by_family.items():
                merged[name].append(chunk)
    claimed.update(snap.owners)
    ranks.update(rank for _, rank in snap.owners)


def _family(metric: cat.Metric, chunks: list[str]) -> Family:
    return EncodedFamily(metric.family, metric.help, metric.type, chunks)
