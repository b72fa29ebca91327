"""The loader's workers as /proc shows them, read from a window's series.

The trainer sums each figure over a loader's live workers (catalogue.WORKER_*): the three
states of their wall time and their reads are counters, read as increases over the
window; memory is a gauge, read at the window's end. A figure that is not exported (no
workers, or not Linux) stays None: unknown, never 0. Failures by cause are totals, read
as dataloader_workers_lost_total is. The largest container of Python objects found among
the dataset's attributes (catalogue.DATASET_OBJECTS: what copy-on-read copies into every
worker, diagnosis.memgrowth) is read from its latest value, its item count from its
`objects` label.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from dataloader_exporter.core import catalogue as cat

Series = Mapping[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class WorkerSignals:
    """What the loader's live workers did in a window, summed over them; None: unknown."""

    # seconds in the window by state (catalogue.WORKER_STATES)
    running: float | None = None
    waiting_for_cpu: float | None = None
    blocked: float | None = None
    # bytes read in the window by source (catalogue.READ_SOURCES)
    storage: float | None = None
    syscalls: float | None = None
    major_faults: float | None = None
    # bytes at the window's end by kind (catalogue.MEMORY_KINDS)
    rss: float | None = None
    pss: float | None = None
    swap: float | None = None
    available: float | None = None  # the least room the trainer's container had, working
    swap_growth: float | None = None  # the workers' swap, last minus first in the window
    max_rss: float | None = None  # the most any worker of the loader held (high-water)
    # bytes/s the live workers' private memory grows, summed over them (the trainer's
    # latest measure, kept after they end); None: not measured
    private_growth: float | None = None

    @property
    def seconds(self) -> float | None:
        """Their wall time in the window, the three states together; None if one is
        unknown."""
        if self.running is None or self.waiting_for_cpu is None or self.blocked is None:
            return None
        return self.running + self.waiting_for_cpu + self.blocked


def _get(series: Series, name: str, **labels: str) -> float | None:
    return series.get((name, tuple(sorted(labels.items()))))


def read_workers(increase: Series, latest: Series, change: Series,
                 lr: dict[str, str]) -> WorkerSignals:
    """One (loader, rank)'s worker figures; `change` is empty for a whole run (no growth
    can be told from one reading)."""
    times = {st: _get(increase, cat.WORKER_TIME.name, **lr, state=st) for st in cat.WORKER_STATES}
    reads = {src: _get(increase, cat.WORKER_READ.name, **lr, source=src)
             for src in cat.READ_SOURCES}
    memory = {k: _get(latest, cat.WORKER_MEMORY.name, **lr, kind=k) for k in cat.MEMORY_KINDS}
    growth = _get(change, cat.WORKER_MEMORY.name, **lr, kind="swap") if change else None
    return WorkerSignals(**times, **reads, **memory,  # the catalogue's label values
                         major_faults=_get(increase, cat.WORKER_MAJOR_FAULTS.name, **lr),
                         swap_growth=growth, max_rss=_get(latest, cat.WORKER_MAX_RSS.name, **lr),
                         private_growth=_get(latest, cat.WORKER_PRIVATE_GROWTH.name, **lr))


@dataclass(frozen=True)
class DatasetContainer:
    """A large container of Python objects among the dataset's attributes: its path
    (``dataset.paths``), its type and its items' (``list``, ``str``), how many items and
    their estimated bytes with the container's (None: not exported, or not a valid figure)."""

    attribute: str
    container: str
    item: str
    objects: float | None
    bytes: float | None


def _count(text: str | None) -> float | None:
    """The `objects` label's item count; None unless it is a decimal integer."""
    return float(text) if text and text.isascii() and text.isdecimal() else None


def read_containers(latest: Series, lr: dict[str, str]) -> tuple[DatasetContainer, ...]:
    """One (loader, rank)'s dataset containers, the largest (by bytes, then items) first;
    empty when none was found or none is exported. The trainer exports only its largest:
    more than one comes only from a range in which that series changed (Prometheus)."""
    out = []
    for (name, labels), value in latest.items():
        d = dict(labels)
        if name != cat.DATASET_OBJECTS.name or d.get("loader") != lr["loader"] or \
                d.get("rank") != lr["rank"]:
            continue
        out.append(DatasetContainer(d.get("attribute", ""), d.get("container", ""),
                                    d.get("item", ""), _count(d.get("objects")),
                                    value if math.isfinite(value) and value >= 0 else None))
    return tuple(sorted(out, key=lambda c: (-(c.bytes or 0.0), -(c.objects or 0.0),
                                            c.attribute)))


def read_failures(latest: Series, lr: dict[str, str]) -> dict[str, float] | None:
    """cause -> failures so far (catalogue.FAILURE_CAUSES); None when the trainer does not
    export causes (then a lost worker's cause is unknown)."""
    causes = {c: _get(latest, cat.FAILURES.name, **lr, cause=c) for c in cat.FAILURE_CAUSES}
    if all(v is None for v in causes.values()):
        return None
    return {c: v or 0.0 for c, v in causes.items()}
