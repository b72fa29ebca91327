"""The collector table, and building the collector set from it: shared by the sidecar's
flags and configuration (exporter.config) and by in-process serving.

Like node_exporter's registerCollector, one entry per collector gives its name, whether
it is on by default, its help and how it is built; the `--collector.NAME` /
`--no-collector.NAME` switches, their DATALOADER_EXPORTER_COLLECTOR_NAME variables and the
order collectors are listed and scraped in all come from it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from dataloader_exporter.core.envnames import ENV_PREFIX
from dataloader_exporter.core.facts.shm import SHM_PATH

from .collectors.base import SourceCollector
from .collectors.gpu_nvml import GpuCollector
from .collectors.host import HostCollector
from .collectors.shm_usage import ShmCollector
from .collectors.supervisor import Supervisor
from .collectors.trainer import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_SERIES,
    DEFAULT_STALE_AFTER,
    TrainerCollector,
)
from .snapshot_retention import KEEP_FAILED_FOR


@dataclass(frozen=True)
class SourceOptions:
    """What the collectors are built from (the serve command's settings for them)."""

    shm_path: str = SHM_PATH
    metrics_dir: str | None = None
    stale_after: float = DEFAULT_STALE_AFTER
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    max_series: int = DEFAULT_MAX_SERIES
    remove_after: float | None = None  # None: default_remove_after(stale_after)
    keep_failed_for: float = KEEP_FAILED_FOR


@dataclass(frozen=True)
class CollectorEntry:
    """One collector: its switch, its default, its help and how it is built."""

    name: str
    default: bool  # on unless switched off
    help: str
    build: Callable[[SourceOptions], SourceCollector]
    # Reads the snapshot directory (--metrics-dir): on by default only when one is given,
    # and switched on without one it is a configuration problem.
    needs_dir: bool = False

    @property
    def flag(self) -> str:
        return f"--collector.{self.name}"

    @property
    def dest(self) -> str:
        return f"collector_{self.name}"

    @property
    def variable(self) -> str:
        return f"{ENV_PREFIX}COLLECTOR_{self.name.upper()}"


def _trainer(o: SourceOptions) -> TrainerCollector:
    if o.metrics_dir is None:
        raise ValueError("the trainer collector needs a metrics directory")
    return TrainerCollector(o.metrics_dir, o.stale_after, max_file_bytes=o.max_file_bytes,
                            max_series=o.max_series, remove_after=o.remove_after,
                            keep_failed_for=o.keep_failed_for)


COLLECTORS: tuple[CollectorEntry, ...] = (
    CollectorEntry("trainer", True, "the trainer collector", _trainer, needs_dir=True),
    CollectorEntry("gpu", True, "the gpu collector", lambda o: GpuCollector()),
    CollectorEntry("shm", True, "the shm collector", lambda o: ShmCollector(o.shm_path)),
    CollectorEntry("host", True, "the host collector", lambda o: HostCollector()),
)


def build_sources(names: Collection[str], options: SourceOptions) -> list[SourceCollector]:
    """The collectors named, built from `options`, in the table's order."""
    return [c.build(options) for c in COLLECTORS if c.name in names]


def system_sources(shm_path: str = SHM_PATH, gpu: bool = True, shm: bool = True,
                   host: bool = True) -> list[SourceCollector]:
    """The GPU, shm and host collectors that were asked for (in-process serving)."""
    wanted = {name for name, on in (("gpu", gpu), ("shm", shm), ("host", host)) if on}
    return build_sources(wanted, SourceOptions(shm_path))


def attach(registry: CollectorRegistry, sources: list[SourceCollector]) -> Supervisor:
    """Registers one Supervisor over `sources` (and the self metrics) in `registry`."""
    supervisor = Supervisor(sources)
    registry.register(supervisor)
    return supervisor
