"""What every source collector shares: a name, health, an error count; and the families
they build from catalogue entries. (Log-once is dataloader_exporter.core.logonce.)"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from prometheus_client.metrics_core import Metric as Family

from dataloader_exporter.core.catalogue import COUNTER, GAUGE, HISTOGRAM, Metric


class SourceCollector(Protocol):
    """A collector of one source (gpu, shm, host, trainer).

    collect() never raises: on a failing source it yields what it can, sets `up`
    False and adds to `errors`. The supervisor turns up/errors into self metrics.
    """

    name: str
    up: bool
    errors: int

    def collect(self) -> Iterable[Family]: ...


def family(metric: Metric, labels: Iterable[str] | None = None) -> Any:
    """An empty Counter/Gauge/HistogramMetricFamily for a catalogue entry.

    Typed Any because each family class has its own add_metric() signature.
    """
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    names = list(metric.labels if labels is None else labels)
    if metric.type == COUNTER:
        return CounterMetricFamily(metric.family, metric.help, labels=names)
    if metric.type == GAUGE:
        return GaugeMetricFamily(metric.name, metric.help, labels=names)
    if metric.type == HISTOGRAM:
        return HistogramMetricFamily(metric.name, metric.help, labels=names)
    raise ValueError(f"unknown metric type {metric.type!r} for {metric.name}")
