"""Snapshot files: a registry written atomically to <dir>/<unique>.prom, in the text format
node_exporter's textfile collector reads, by a thread of its own, so that a slow or
broken volume never holds up training.

The text is prometheus_client's text format as generate_latest writes it, encoded by the
exporter's fast encoder (exporter/exposition.py: the same bytes, about a third of the
interpreter time), and written as write_to_textfile does (a temporary file beside it,
renamed), so the trainer's interpreter is held as briefly as the figures allow.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from dataloader_exporter.exporter.exposition import text

from .failure_causes import is_torch_worker_error

log = logging.getLogger("dataloader_exporter.instrument")

REFRESH_EVERY = 5  # an idle writer renders at least one interval in this many
_UNWRITTEN = object()  # an activity no call returns: the next interval writes


def snapshot_path(directory: str) -> str:
    """A file name unique to this process: host, pid and a random token."""
    host = socket.gethostname().replace(os.sep, "_") or "host"
    return os.path.join(directory, f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}.prom")


class SnapshotWriter:
    """Writes a registry to <dir>/<unique>.prom every interval, atomically (rename).

    Writes keep their own cadence, one an interval after the last one ended, whatever the
    loop does, so that a snapshot is a fair sample of gauges such as
    dataloader_workers_active (with epochs shorter than the interval, writes made as
    epochs end would all catch non-persistent workers between two epochs). The end of an
    epoch (wake()) brings the next write to within PROMPT seconds, which changes nothing
    at the default interval of a second; a failure (ask()) is written at once, by this
    thread (never the loop's: a hung volume must not hang training), and its exception
    may wait a bounded time for it (wait_for()).
    Failures (missing or unwritable directory, full disk) are logged once and retried
    quietly; training never sees them. The last snapshot is written at interpreter exit.

    activity (optional) returns a value equal across two calls when nothing was recorded
    in between (Hub.activity). An interval's write whose activity equals the last write's
    is skipped, at most refresh_every - 1 intervals in a row: the file is only touched
    (os.utime), since its mtime is its freshness to the sidecar, and what changes without
    a record (workers' liveness and memory) is rendered at least every refresh_every
    intervals. Asked-for writes (ask, wake, close) are never skipped.
    """

    PROMPT = 1.0

    def __init__(self, registry: CollectorRegistry, directory: str, interval: float,
                 on_exit: Callable[[], None] | None = None,
                 activity: Callable[[], object] | None = None,
                 refresh_every: int = REFRESH_EVERY) -> None:
        self.registry = registry
        self.on_exit = on_exit  # called at interpreter exit, before the last write
        self.directory = directory
        self.interval = interval
        self.path = snapshot_path(directory)
        self.writes = 0
        self.failures = 0
        self.skips = 0  # intervals whose write was skipped, the file touched
        self.refresh_every = refresh_every
        self._activity = activity
        self._written: object = _UNWRITTEN  # the activity the file shows
        self._skipped = 0  # intervals skipped since the last write
        self._pid = os.getpid()
        self._wake = threading.Event()
        self._urgent = False
        self._due = time.monotonic()
        self._prompt = math.inf  # a write asked for by then (the end of an epoch)
        self._prompt_asked = -math.inf  # when it was asked: a write begun later answers it
        self._stop = threading.Event()
        self._write_lock = threading.Lock()
        self._done = threading.Condition()
        self._started = self._finished = 0  # writes begun and ended
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="dataloader-exporter-snapshot",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        if self.on_exit is not None and os.getpid() == self._pid:
            try:
                self.on_exit()
            except Exception:  # the last snapshot matters more
                log.debug("exit hook failed", exc_info=True)
        self.close()

    def wake(self) -> None:
        """Asks for a write within PROMPT seconds."""
        now = time.monotonic()
        self._prompt_asked = now
        self._prompt = min(self._prompt, now + self.PROMPT)
        self._wake.set()

    def ask(self) -> int:
        """Asks for a write at once; the ticket wait_for() takes."""
        with self._done:
            ticket = self._started
        self._urgent = True
        self._wake.set()
        return ticket

    def wait_for(self, ticket: int, timeout: float) -> bool:
        """Waits up to `timeout` for a write begun after ask() returned `ticket`."""
        with self._done:
            return self._done.wait_for(lambda: self._finished > ticket, timeout)

    def close(self) -> None:
        """Stops the thread and writes one last snapshot."""
        atexit.unregister(self._at_exit)
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        self.write()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            asked = self._urgent or now >= self._prompt
            if asked or now >= self._due:
                self._urgent = False  # an ask() during the write asks again
                if asked:
                    self.write()
                else:
                    self.tick()
                if self._prompt_asked <= now:  # asked before this write began: answered
                    self._prompt = math.inf
                self._due = time.monotonic() + self.interval  # a slow write is no busy loop
            self._wake.wait(max(0.0, min(self._due, self._prompt) - time.monotonic()))
            self._wake.clear()

    def tick(self) -> bool:
        """One interval's write, or its skip (see the class); False on a failed write."""
        return self._skip() or self.write()

    def _skip(self) -> bool:
        """Whether this interval's write is skipped (see the class), the file touched."""
        if (self._activity is None or self._skipped >= self.refresh_every - 1
                or os.getpid() != self._pid):
            return False
        try:
            if self._activity() != self._written:
                return False
            os.utime(self.path)  # the file gone or unwritable: a write tells
        except Exception as e:
            if is_torch_worker_error(e):
                raise
            return False
        self._skipped += 1
        self.skips += 1
        return True

    def _now_active(self) -> object:
        try:
            return self._activity() if self._activity is not None else _UNWRITTEN
        except Exception as e:
            if is_torch_worker_error(e):
                raise
            return _UNWRITTEN

    def write(self) -> bool:
        """One atomic write; False (and one log line per failure streak) on error."""
        if os.getpid() != self._pid:  # a forked child must not write its parent's file
            return False
        with self._write_lock:
            with self._done:
                self._started += 1
            active = self._now_active()  # read before the figures
            try:
                self._replace(text(self.registry.collect()))
                self._written, self._skipped = active, 0
            except Exception as e:
                if is_torch_worker_error(e):  # torch's SIGCHLD word: the loop's, not ours
                    raise
                self._written = _UNWRITTEN
                self.failures += 1
                if not self._failing:
                    self._failing = True
                    log.warning("dataloader-exporter: cannot write metrics snapshot %s: %s "
                                "(training goes on; will retry quietly)", self.path, e)
                return False
            finally:
                with self._done:
                    self._finished += 1
                    self._done.notify_all()
            if self._failing:
                self._failing = False
                log.info("dataloader-exporter: metrics snapshots to %s work again", self.path)
            self.writes += 1
            return True

    def _replace(self, data: bytes) -> None:
        """`data` as the file, atomically: a temporary beside it (its name does not end in
        .prom, so no reader takes it), renamed; the directory made again if it is gone."""
        tmp = f"{self.path}.{os.getpid()}.{threading.get_ident()}"
        try:
            try:
                out = open(tmp, "wb")  # noqa: SIM115  (closed below)
            except FileNotFoundError:
                os.makedirs(self.directory, exist_ok=True)
                out = open(tmp, "wb")  # noqa: SIM115
            with out:
                out.write(data)
            os.rename(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
