"""One collection for many concurrent scrapes, encoded once per format.

Collecting reads every source (snapshot files, NVML, /proc), so it must not run once per
client. A scrape that arrives while a collection is running joins it (single flight, as
Go's singleflight); the next one after it finished starts a fresh one, so no answer is
older than the scrape that asked for it by more than one collection. Each collection encodes
each format (text, OpenMetrics, gzip or not) at most once, whoever asks first.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
from collections.abc import Callable
from concurrent.futures import Executor

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric as Family

from dataloader_exporter.exporter import exposition

# A format is (openmetrics, gzipped).
Format = tuple[bool, bool]


class Collected:
    """The families of one collection and their encodings, made on first request."""

    def __init__(self, families: list[Family]) -> None:
        self.families = families
        self._lock = threading.Lock()
        self._bodies: dict[Format, bytes] = {}

    def body(self, fmt: Format) -> bytes:
        with self._lock:  # concurrent askers for one format wait for one encoding
            body = self._bodies.get(fmt)
            if body is None:
                openmetrics, gzipped = fmt
                plain = self._bodies.get((openmetrics, False))
                if plain is None:
                    encode = exposition.openmetrics if openmetrics else exposition.text
                    plain = self._bodies[(openmetrics, False)] = encode(self.families)
                # level 1: level 9 costs about 10x the time for a few % of size
                body = gzip.compress(plain, compresslevel=1) if gzipped else plain
                self._bodies[fmt] = body
            return body


def content_type(openmetrics: bool) -> str:
    return exposition.OPENMETRICS_CONTENT_TYPE if openmetrics else exposition.TEXT_CONTENT_TYPE


class SingleFlight:
    """Collects a registry in an executor, sharing a running collection among callers.

    Used from one event loop's thread only (no lock needed for the flight itself).
    """

    def __init__(self, registry: CollectorRegistry, executor: Executor,
                 collect: Callable[[CollectorRegistry], list[Family]] | None = None) -> None:
        self._registry = registry
        self._executor = executor
        self._collect = collect or (lambda r: list(r.collect()))
        self._flight: asyncio.Future[Collected] | None = None

    async def body(self, fmt: Format) -> bytes:
        loop = asyncio.get_running_loop()
        flight = self._flight
        if flight is None or flight.done():
            flight = self._flight = loop.run_in_executor(self._executor, self._run)
        # shield: one client going away must not cancel the others' collection
        collected = await asyncio.shield(flight)
        return await loop.run_in_executor(self._executor, collected.body, fmt)

    def _run(self) -> Collected:
        return Collected(self._collect(self._registry))
