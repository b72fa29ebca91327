"""Deleting old snapshot files, so that a directory trainers restart into stops growing.

Each trainer restart leaves a file under a new name, and every scrape lists the whole
directory, so the sidecar deletes a regular ``*.prom`` file not rewritten for
``remove_after`` seconds (by default 10 x stale_after, at least 10 minutes; math.inf
never deletes), and write_to_textfile's temporary files left that long by a writer killed
mid-write. A live trainer rewrites its file every second and loses nothing. The last
snapshot of a run that ended badly (no dataloader_exit_timestamp_seconds, a lost worker,
a failure) is the evidence and is kept for ``keep_failed_for`` instead, the newest
KEEP_FAILED_FILES of them. A file that cannot be deleted (a read-only directory) is
logged once and stays; nothing here fails a scrape.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Callable

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.core.logonce import LogOnce
from dataloader_exporter.exporter.collectors import snapshot
from dataloader_exporter.exporter.collectors.snapshot import SUFFIX, Rejected, Stamp

log = logging.getLogger("dataloader_exporter.exporter")

# Files are deleted once not rewritten for 10 times stale_after, and never sooner than
# 10 minutes: a trainer hung that long that resumes writes its file anew.
REMOVE_AFTER_STALE_FACTOR = 10.0
REMOVE_AFTER_MIN = 600.0
# The last snapshot of a run that ended badly is kept this long instead (7 days: a crash
# on a Friday night is looked at on Monday), the newest KEEP_FAILED_FILES of them (a crash
# loop must not fill the volume).
KEEP_FAILED_FOR = 7 * 86400.0
KEEP_FAILED_FILES = 16
_TEMPORARY = re.compile(r"\.prom\.[0-9]+\.[0-9]+\Z")  # write_to_textfile's, mid-write

Reader = Callable[[str, int], tuple[bytes, Stamp]]


def default_remove_after(stale_after: float) -> float:
    """When a file not rewritten is deleted, by default, for a given stale_after."""
    return max(REMOVE_AFTER_STALE_FACTOR * stale_after, REMOVE_AFTER_MIN)


class SnapshotRetention:
    """Deletes the old files of one snapshot directory, one listing at a time.

    The trainer collector runs sweep() on the listing each scrape makes, so the directory
    is listed once per scrape and a file deleted is never read nor counted. read,
    max_file_bytes and max_series are the collector's: a file past remove_after is read
    (once per version) only to tell whether its run ended badly.
    """

    def __init__(self, directory: str, remove_after: float, read: Reader,
                 max_file_bytes: int, max_series: int,
                 keep_failed_for: float = KEEP_FAILED_FOR) -> None:
        self.directory = directory
        self.remove_after = remove_after
        self.keep_failed_for = max(keep_failed_for, remove_after)
        self.read = read
        self.max_file_bytes = max_file_bytes
        self.max_series = max_series
        # Files past remove_after whose run ended badly: path -> (version, mtime).
        self.failed: dict[str, tuple[Stamp, float]] = {}
        # Files past remove_after read and found to have ended well, whose deletion
        # failed (a read-only directory): path -> version, not read again.
        self._ended_well: dict[str, Stamp] = {}
        self._log = LogOnce(log)

    def sweep(self, entries: list[os.DirEntry[str]], now: float) -> set[str]:
        """Deletes the old files among one listing of the directory; the paths deleted."""
        present = {entry.path for entry in entries}
        self.failed = {p: v for p, v in self.failed.items() if p in present}
        self._ended_well = {p: v for p, v in self._ended_well.items() if p in present}
        removed: set[str] = set()
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)  # cached by the entry for the reader
            except OSError:  # vanished since the listing
                continue
            if not stat.S_ISREG(st.st_mode) or now - st.st_mtime <= self.remove_after:
                continue
            if entry.name.endswith(SUFFIX):
                old = self._expired(entry.path, snapshot.stamp_of(st), st.st_mtime, now)
            else:
                old = bool(_TEMPORARY.search(entry.name))
            if old and self._remove(entry.path):
                removed.add(entry.path)
        return removed

    def _expired(self, path: str, stamp: Stamp, mtime: float, now: float) -> bool:
        """Whether a file past remove_after goes now: unless it is the last snapshot of a
        run that ended badly (read once to tell), among the newest KEEP_FAILED_FILES
        such, and younger than keep_failed_for."""
        if self._ended_well.get(path) == stamp:  # read before, its deletion failed
            return True
        known = self.failed.get(path)
        if known is None or known[0] != stamp:
            if not self._ended_badly(path):
                self._ended_well[path] = stamp
                return True
            self.failed[path] = (stamp, mtime)
            newest = sorted(self.failed, key=lambda p: self.failed[p][1], reverse=True)
            for old in newest[KEEP_FAILED_FILES:]:
                del self.failed[old]  # forgotten: deleted below, or at the next sweep
            if path not in self.failed:
                return True
        if now - mtime > self.keep_failed_for:
            self.failed.pop(path, None)
            return True
        return False

    def _ended_badly(self, path: str) -> bool:
        """Whether a snapshot file is the last of a run that did not end well: a loader
        whose rank has no dataloader_exit_timestamp_seconds (the process never exited
        normally), or with a lost worker or a failure. A file that cannot be read or is
        not valid did not: it goes like any other."""
        try:
            data, _ = self.read(path, self.max_file_bytes)
            snap = snapshot.load(data, self.max_series)
        except (OSError, Rejected):
            return False
        for (_, rank), by_family in snap.owners.items():
            if cat.EXITED.name not in snap.ranks.get(rank, {}):
                return True
            for name in (cat.WORKERS_LOST.name, cat.FAILURES.name):
                for line in by_family.get(name, "").splitlines():
                    if float(line.rsplit(" ", 1)[1]) > 0:
                        return True
        return False

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
