"""Runs the source collectors for each scrape and reports on them (self metrics).

Each source collector is timed; one that raises despite its contract is counted as
down with an error and logged once, so a bug in one source never fails the scrape.
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Iterator, Sequence

from prometheus_client.metrics_core import Metric as Family
from prometheus_client.registry import Collector

from dataloader_exporter import __version__
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.core.logonce import LogOnce

from .base import SourceCollector, family

log = logging.getLogger("dataloader_exporter.exporter")


class Supervisor(Collector):
    """The one collector registered in the exporter's registry."""

    def __init__(self, sources: Sequence[SourceCollector], build_info: bool = True) -> None:
        self.sources = list(sources)
        self.build_info = build_info
        self._log = LogOnce(log)
        self.collections = 0  # one per collect(); the HTTP server shares one among scrapes

    def describe(self) -> Iterator[Family]:
        """The families collect() may yield, so a registry refuses duplicates of them."""
        sources = {s.name for s in self.sources}
        own = [cat.COLLECTOR_UP, cat.COLLECTOR_DURATION, cat.COLLECTOR_ERRORS, cat.COLLECTIONS]
        if self.build_info:
            own.append(cat.BUILD_INFO)
        if cat.TRAINER in sources:
            own += [cat.SNAPSHOT_FILES, cat.SNAPSHOT_AGE, cat.SNAPSHOT_ERRORS]
        for metric in cat.ALL:
            if metric.source in sources or metric in own:
                yield family(metric)

    def collect(self) -> Iterator[Family]:
        self.collections += 1
        up, duration, errors = (family(cat.COLLECTOR_UP), family(cat.COLLECTOR_DURATION),
                                family(cat.COLLECTOR_ERRORS))
        for source in self.sources:
            start = time.perf_counter()
            try:
                families = list(source.collect())
                self._log.cleared(source.name)
            except Exception as e:
                families = []
                source.up = False
                source.errors += 1
                self._log.problem(source.name, "collector %s failed: %r", source.name, e)
            yield from families
            up.add_metric([source.name], 1.0 if source.up else 0.0)
            duration.add_metric([source.name], time.perf_counter() - start)
            errors.add_metric([source.name], source.errors)
        yield up
        yield duration
        yield errors
        collections = family(cat.COLLECTIONS)
        collections.add_metric([], self.collections)
        yield collections
        if self.build_info:
            info = family(cat.BUILD_INFO)
            info.add_metric([__version__, platform.python_version()], 1)
            yield info

    def close(self) -> None:
        for source in self.sources:
            close = getattr(source, "close", None)
            if close is not None:
                close()
