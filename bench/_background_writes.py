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
    once per `interval` s of instrumented loops, while one runs: it counts their time in
    ticks of TICK s, so every workload gets its share of writes, not a chance number."""

    TICK = 0.02

    def __init__(self, registry: CollectorRegistry, interval: float = 1.0) -> None:
        self.registry = registry
        self._dir = tempfile.TemporaryDirectory(prefix="overhead-snapshots-")
        self._writer = SnapshotWriter(registry, self._dir.name, interval)  # never started
        self.cpu_s: list[float] = []  # the writing thread's CPU time (GIL held) per write
        self._running, self._busy = threading.Event(), threading.Lock()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def during(self, run: Callable[[], tuple[int, int]]) -> tuple[int, int]:
        """Runs `run` with writes enabled; a write under way when it ends finishes here."""
        self._running.set()
        try:
            return run()
        finally:
            self._running.clear()
            with self._busy:
                pass

    def _run(self, interval: float) -> None:
        ran = 0.0  # instrumented time since the last write, in ticks seen running
        while True:  # a daemon: it ends with the process
            time.sleep(self.TICK)
            with self._busy:
                if self._running.is_set():
                    ran += self.TICK
                    if ran >= interval:
                        ran = 0.0
                        t0 = thread_time()
                        self._writer.write()
                        self.cpu_s.append(thread_time() - t0)
