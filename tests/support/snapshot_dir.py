"""A directory of snapshot files as the trainer collector sees it: files written with a
chosen age, and one scrape served in both exposition formats."""

from __future__ import annotations

import os
import time
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.exporter import exposition
from dataloader_exporter.exporter.collectors.supervisor import Supervisor
from dataloader_exporter.exporter.collectors.trainer import TrainerCollector
from support.helpers import parse

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
T0 = (cat.BATCHES.name, (("loader", "t"), ("rank", "0")))


def served(collector: TrainerCollector) -> tuple[Samples, str]:
    """One scrape in each format; the strict OpenMetrics parser must accept it."""
    registry = CollectorRegistry()
    registry.register(Supervisor([collector]))
    text = exposition.text(registry.collect()).decode()
    om = exposition.openmetrics(registry.collect()).decode()
    assert list(openmetrics_families(om))
    return parse(text), text + om


def write(path: Path, data: bytes, age: float = 0.0, mtime: float | None = None) -> Path:
    path.write_bytes(data)
    when = time.time() - age if mtime is None else mtime
    os.utime(path, (when, when))
    return path
