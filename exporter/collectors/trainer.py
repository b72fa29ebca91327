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
  By default that is 10 x stale_after and at least 10 minutes, long enough to look at a
  crashed trainer's last snapshot (``remove_after=math.inf`` never deletes: for a
  directory that something else cleans). node_exporter's textfile collector, which never
  deletes, may read the same directory. Deletion failures (a read-only directory) are
  logged once and never fail the scrape; such files count as stale.
- any other file is read and validated (snapshot.py) unless it is unchanged since the
  last scrape (same inode, mtime and size): then its earlier verdict is reused, parsed
  samples or rejection alike, so several scrapers within one write period parse a file
  once and a bad file is neither read, counted nor logged again. A rejected file is
  skipped whole, counted in ``snapshot_errors_total{reason}`` and in the collector's
  error count and logged (by name and reason) once per file and reason: a bad file
  rewritten every second counts once while it stays bad for the same reason.

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
from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import Metric as Family

from exporter import catalogue as cat
from exporter.exposition import EncodedFamily

from . import snapshot
from .base import LogOnce, family
from .snapshot import Owner, Rejected, Snapshot, Stamp

log = logging.getLogger("exporter")

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
_TEMPORARY = re.compile(r"\.prom\.[0-9]+\.[0-9]+\Z")  # write_to_textfile's, mid-write
_TRAINER = tuple(m for m in cat.ALL if m.source == cat.TRAINER)


def default_remove_after(stale_after: float) -> float:
    """When a file not rewritten is deleted, by default, for a given stale_after."""
    return max(REMOVE_AFTER_STALE_FACTOR * stale_after, REMOVE_AFTER_MIN)


# A verdict on one version of a file: its samples, or why it was rejected.
_Verdict = tuple[Stamp, Snapshot | Rejected]


class TrainerCollector:
    """Trainer metrics from the snapshot files of a directory."""

    name = cat.TRAINER

    def __init__(self, directory: str, stale_after: float = DEFAULT_STALE_AFTER,
                 clock: Callable[[], float] = time.time,
                 max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 max_series: int = DEFAULT_MAX_SERIES,
                 remove_after: float | None = None) -> None:
        """remove_after None: default_remove_after(stale_after); math.inf: never delete."""
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
        self.up = True
        self.errors = 0
        self.rejected = dict.fromkeys(snapshot.REASONS, 0)  # files skipped, once per reason
        self._log = LogOnce(log)
        self._lock = threading.Lock()  # a warm-up collection may overlap a scrape
        # Verdicts by path, only for entries present (and, if regular, fresh).
        self._verdicts: dict[str, _Verdict] = {}
        self._bad: dict[str, str] = {}  # path -> the reason it was counted and logged for

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
        self._bad = {p: r for p, r in self._bad.items() if p in self._verdicts}
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
            if regular and now - st.st_mtime > self.remove_after and self._remove(entry.path):
                continue
            if regular and now - st.st_mtime > self.stale_after:
                stale += 1
                continue
            old = verdicts.get(entry.path)
            if old is not None and old[0] == stamp:
                self._verdicts[entry.path] = old  # unchanged: neither read nor counted again
            elif not regular:
                kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
                self._keep(name, entry.path, (stamp, Rejected(snapshot.NOT_REGULAR, kind)))
            if regular:
                fresh.append((st.st_mtime, name, entry.path, stamp))
        return fresh, stale

    def _verdict(self, name: str, path: str, stamp: Stamp) -> Snapshot | Rejected | None:
        """The verdict on a fresh file, read and validated unless unchanged; None if gone."""
        known = self._verdicts.get(path)
        if known is not None and known[0] == stamp:
            return known[1]
        try:
            data, stamp = snapshot.read(path, self.max_file_bytes)
            verdict: Snapshot | Rejected = snapshot.load(data, self.max_series)
        except FileNotFoundError:
            return None
        except Rejected as e:
            verdict = e
        except Exception as e:  # a bug here must cost one file, not the scrape
            verdict = Rejected(snapshot.INVALID, f"validation failed ({type(e).__name__})")
        self._keep(name, path, (stamp, verdict))
        return verdict

    def _keep(self, name: str, path: str, verdict: _Verdict) -> None:
        """Records a verdict; counts and logs a rejection once per file and reason (a bad
        file rewritten every second counts once while it stays bad for the same reason)."""
        self._verdicts[path] = verdict
        result = verdict[1]
        if isinstance(result, Snapshot):
            if self._bad.pop(path, None) is not None:
                log.info("snapshot %a is valid again", name)
            return
        if self._bad.get(path) == result.reason:
            return
        self._bad[path] = result.reason
        self.rejected[result.reason] += 1
        self.errors += 1
        log.warning("skipping snapshot %a in %s: %s (%s)", name, self.directory,
                    result.reason, result.detail)

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
