"""The trainer collector: merges the snapshot files trainers write into one scrape.

Each trainer process rewrites ``<dir>/<host>-<pid>-<token>.prom`` about every second,
atomically (prometheus_client's write_to_textfile: write ``<name>.prom.<pid>.<thread>``,
then rename). At each scrape this collector lists the directory and, for each
``*.prom`` entry:

- a symbolic link, FIFO, socket, device or directory is never opened: it is skipped
  and counted as ``not_regular``. Symbolic links are not followed at all, even to a file
  inside the directory: the snapshot writer never makes one, and following one would let
  anyone who can write to the directory make the sidecar read any file it can read.
- a regular file not rewritten for ``stale_after`` seconds (its writer is gone or hung)
  is dropped without being read; one not rewritten for ``remove_after`` seconds is
  deleted, with the writer's temporary files left behind that long by a writer killed
  mid-write. This collector (the sidecar) is what deletes them: each trainer restart
  leaves a file under a new name, and a directory that only grows makes every scrape
  slower. A running trainer loses nothing: it rewrites its file every second, and
  should a trainer hung for ``remove_after`` resume, its next write makes the file anew.
  By default that is 10 x stale_after and at least 10 minutes (``remove_after=math.inf``
  never deletes: for a directory that something else cleans). The last snapshot of a
  run that ended badly (no dataloader_exit_timestamp_seconds: killed or crashed hard;
  a lost worker; a failure) is kept for ``keep_failed_for`` instead (7 days), the newest
  KEEP_FAILED_FILES of them: it is the evidence, and a crash is looked at later.
  node_exporter's textfile collector, which never deletes, may read the same directory.
  Deletion failures (a read-only directory) are logged once and never fail the scrape;
  such files count as stale.
- any other file is read and validated (snapshot.py) unless it is unchanged since the
  last scrape (same inode, mtime and size): then its earlier verdict is reused, parsed
  samples or rejection alike, so several scrapers within one write period parse a file
  once and a bad file is neither read, counted nor logged again. A rejected file is
  skipped whole, counted in ``snapshot_errors_total{reason}`` and in the collector's
  error count and logged (by name and reason) once per file and reason: a bad file
  rewritten every second counts once while it stays bad for the same reason.
- a file whose content is rejected is read again at once, and the rejection stands only
  if the second read finds the same bytes; a whole second read is served, and for one
  that differs and is not whole either the file's last whole version is served (none if
  it never was whole), uncounted, and it is read again at the next scrape. An empty file
  is served as its last whole version too, and counts (as invalid) only once it has
  stayed empty for EMPTY_GRACE. Both are for writers that rewrite their file in place
  (truncate, then write) instead of renaming: a read between the two finds it empty, one
  during the write finds part of it, and neither may cost an error or a log line (a file
  rewritten in place 100 times a second counted 209 errors and wrote 422 log lines in
  15 s).
- a rejection is remembered as a Rejected made anew (reason and detail, never raised)
  with the file's version (inode, mtime, size): never the exception caught, whose
  traceback holds the validator's frames and so the parsed file (20 rejected files of
  1.9 MB took the sidecar from 26 to 620 MiB), nor the bytes. The files rejected, or
  valid again, in one scrape are logged one line each up to LOG_EACH of them, else in
  one line with their number by reason and a few names (10,000 junk files wrote 10,002
  lines).

When a trainer restarts, its new file and the old one both hold series for the same
(loader, rank) until the old one goes stale; the newest file wins, so nothing is
counted twice. A rejected file never affects another file's series (nor claims its
loader and rank from an older file).
"""

from __future__ import annotations

import logging
import os
import re
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

from . import snapshot
from .base import family
from .snapshot import Owner, Rejected, Snapshot, Stamp

log = logging.getLogger("dataloader_exporter.exporter")

SUFFIX = ".prom"
DEFAULT_STALE_AFTER = 30.0
# Measured on real snapshots from the real writer: 8 loaders of 16 workers each make
# 98,157 bytes and 1,144 series (one loader of 2 workers: 10,568 bytes, 101 series). The
# bounds are 21 and 17 times that; a real file of 19,000 series (200 loaders, 1.55 MB)
# takes about 55 ms to parse and validate, once per version.
DEFAULT_MAX_FILE_BYTES = 2 * 1024 * 1024
DEFAULT_MAX_SERIES = 20_000
# Files are deleted once not rewritten for 10 times stale_after, and never sooner than
# 10 minutes (see the module's docstring).
REMOVE_AFTER_STALE_FACTOR = 10.0
REMOVE_AFTER_MIN = 600.0
# The last snapshot of a run that ended badly (no normal exit, a lost worker, a failure)
# is kept this long instead (7 days: a crash on a Friday night is looked at on Monday),
# the newest KEEP_FAILED_FILES of them (a crash loop must not fill the volume).
KEEP_FAILED_FOR = 7 * 86400.0
KEEP_FAILED_FILES = 16
_TEMPORARY = re.compile(r"\.prom\.[0-9]+\.[0-9]+\Z")  # write_to_textfile's, mid-write
_TRAINER = tuple(m for m in cat.ALL if m.source == cat.TRAINER)


def default_remove_after(stale_after: float) -> float:
    """When a file not rewritten is deleted, by default, for a given stale_after."""
    return max(REMOVE_AFTER_STALE_FACTOR * stale_after, REMOVE_AFTER_MIN)


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
        """remove_after None: default_remove_after(stale_after); math.inf: never delete.
        read: snapshot.read, or a fake that tears reads for tests. keep_failed_for: how
        long the last snapshot of a run that ended badly is kept (never less than
        remove_after)."""
        if remove_after is None:
            remove_after = default_remove_after(stale_after)
        if remove_after < stale_after:
            raise ValueError("remove_after must not be shorter than stale_after")
        self.directory = directory
        self.stale_after = stale_after
        self.clock = clock
        self.max_file_bytes = max_file_bytes
        self.max_series = max_series
        self.remove_after = remove_after
        self.keep_failed_for = max(keep_failed_for, remove_after)
        self.read = read
        # Files past remove_after whose run ended badly: path -> (version, mtime).
        self._failed: dict[str, tuple[Stamp, float]] = {}
        # Files past remove_after read and found to have ended well, whose deletion
        # failed (a read-only directory): path -> version, not read again.
        self._ended_well: dict[str, Stamp] = {}
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

    def collect(self) -> Iterator[Family]:
        with self._lock:
            families = self._collect()
        yield from families

    def _collect(self) -> list[Family]:
        now = self.clock()
        entries = self._list()
        if entries is None:  # unreadable for now: keep what is known of the files
            return [self._errors()]
        fresh, stale = self._classify(entries, now)
        merged: dict[str, list[str]] = {m.name: [] for m in _TRAINER}
        claimed: set[Owner] = set()  # (loader, rank) pairs of newer files
        newest = None
        for mtime, name, path, stamp in sorted(fresh, key=lambda f: (f[0], f[1]), reverse=True):
            verdict = self._verdict(name, path, stamp)
            if isinstance(verdict, Snapshot):
                newest = mtime if newest is None else max(newest, mtime)
                claimed |= _merge(verdict, merged, claimed)
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
        are not regular files, deletes old files, forgets verdicts on files gone."""
        verdicts, self._verdicts = self._verdicts, {}
        fresh, stale = [], 0
        present = {entry.path for entry in entries}
        self._last_whole = {p: v for p, v in self._last_whole.items() if p in present}
        self._failed = {p: v for p, v in self._failed.items() if p in present}
        self._ended_well = {p: v for p, v in self._ended_well.items() if p in present}
        for entry in entries:
            name = entry.name
            if not name.endswith(SUFFIX):
                if _TEMPORARY.search(name):
                    self._remove_if_old(entry, now)
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:  # vanished since the listing: not an error
                continue
            stamp, regular = snapshot.stamp_of(st), stat.S_ISREG(st.st_mode)
            if regular and now - st.st_mtime > self.remove_after and self._expired(
                    entry.path, stamp, st.st_mtime, now) and self._remove(entry.path):
                continue
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
        or caught mid-write (read again at the next scrape: the module's docstring)."""
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

    def _expired(self, path: str, stamp: Stamp, mtime: float, now: float) -> bool:
        """Whether a file past remove_after goes now: unless it is the last snapshot of a
        run that ended badly (read once to tell), among the newest KEEP_FAILED_FILES
        such, and younger than keep_failed_for."""
        if self._ended_well.get(path) == stamp:  # read before, its deletion failed
            return True
        known = self._failed.get(path)
        if known is None or known[0] != stamp:
            if not self._ended_badly(path):
                self._ended_well[path] = stamp
                return True
            self._failed[path] = (stamp, mtime)
            newest = sorted(self._failed, key=lambda p: self._failed[p][1], reverse=True)
            for old in newest[KEEP_FAILED_FILES:]:
                del self._failed[old]  # forgotten: deleted below, or at the next scrape
            if path not in self._failed:
                return True
        if now - mtime > self.keep_failed_for:
            self._failed.pop(path, None)
            return True
        return False

    def _ended_badly(self, path: str) -> bool:
        """Whether a snapshot file is the last of a run that did not end well: a loader
        without dataloader_exit_timestamp_seconds (the process never exited normally),
        with a lost worker or a failure. A file that cannot be read or is not valid did
        not: it goes as before."""
        try:
            data, _ = self.read(path, self.max_file_bytes)
            snap = snapshot.load(data, self.max_series)
        except (OSError, Rejected):
            return False
        for by_family in snap.owners.values():
            if cat.EXITED.name not in by_family:
                return True
            for name in (cat.WORKERS_LOST.name, cat.FAILURES.name):
                for line in by_family.get(name, "").splitlines():
                    if float(line.rsplit(" ", 1)[1]) > 0:
                        return True
        return False

    def _remove_if_old(self, entry: os.DirEntry[str], now: float) -> None:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            return
        if stat.S_ISREG(st.st_mode) and now - st.st_mtime > self.remove_after:
            self._remove(entry.path)

    def _remove(self, path: str) -> bool:
        """Deletes an old file; False (logged once) if it is still there."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._log.problem("remove", "cannot delete old snapshots in %s (%s); they are "
                              "skipped, but the directory keeps growing", self.directory,
                              e.strerror or type(e).__name__)
            return False
        self._log.cleared("remove")
        return True


def _merge(snap: Snapshot, merged: dict[str, list[str]],
           claimed: set[Owner]) -> set[Owner]:
    """Adds one file's series unless a newer file has its (loader, rank); returns its own."""
    owners = set()
    for owner, by_family in snap.owners.items():
        if owner in claimed:
            continue
        owners.add(owner)
        for name, chunk in by_family.items():
            merged[name].append(chunk)
    return owners


def _family(metric: cat.Metric, chunks: list[str]) -> Family:
    return EncodedFamily(metric.family, metric.help, metric.type, chunks)
