"""The trainer's background in bench/overhead.py: snapshot writes during instrumented loops."""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from time import thread_time

from prometheus_client import CollectorRegistry

from dataloader_exporter.instrument.snapshot_writer import SnapshotWriter


class Background:
    """Writes a snapshot of a registry (SnapshotWriter.write, what the writer's thread runs)
    once per `interval` s of instrumented loops, while one runs, so every workload gets its
    share of writes, not a chance number.

    Like the real writer's thread, this one wakes only to write: it is armed before a loop
    starts and disarmed after it ends, each time with a handshake outside the timed loop,
    and sleeps until the interval's instrumented time is up. (A thread that polled, say
    every 20 ms, would take the interpreter's lock from the loop 50 times a second, a cost
    the real writer does not have.)"""

    def __init__(self, registry: CollectorRegistry, interval: float = 1.0) -> None:
        self.registry = registry
        self.interval = interval
        self._dir = tempfile.TemporaryDirectory(prefix="overhead-snapshots-")
        self._writer = SnapshotWriter(registry, self._dir.name, interval)  # never started
        self.cpu_s: list[float] = []  # the writing thread's CPU time (GIL held) per write
        self._left = interval  # instrumented seconds until the next write
        self._cv = threading.Condition()
        self._state = "idle"  # idle -> armed (a loop runs) -> ending -> idle
        self._acked = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def during(self, run: Callable[[], tuple[int, int]]) -> tuple[int, int]:
        """Runs `run` with writes enabled; a write under way when it ends finishes here."""
        self._handshake("armed")
        try:
            return run()
        finally:
            self._handshake("ending")

    def _handshake(self, state: str) -> None:
        with self._cv:
            self._state, self._acked = state, False
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._acked)

    def _run(self) -> None:
        with self._cv:
            while True:  # a daemon: it ends with the process
                self._cv.wait_for(lambda: self._state == "armed" and not self._acked)
                start = time.monotonic()
                self._acked = True
                self._cv.notify_all()
                while not self._cv.wait_for(lambda: self._state == "ending",
                                            max(0.0, self._left - (time.monotonic() - start))):
                    t0 = thread_time()
                    self._writer.write()
                    self.cpu_s.append(thread_time() - t0)
                    start, self._left = time.monotonic(), self.interval
                self._left -= time.monotonic() - start
                self._state, self._acked = "idle", True
                self._cv.notify_all()
