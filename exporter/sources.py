"""Building the collector set, shared by the sidecar CLI and in-process serving."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from dataloader_exporter.core.facts.shm import SHM_PATH

from .collectors.base import SourceCollector
from .collectors.gpu import GpuCollector
from .collectors.host import HostCollector
from .collectors.shm import ShmCollector
from .collectors.supervisor import Supervisor


def system_sources(shm_path: str = SHM_PATH, gpu: bool = True, shm: bool = True,
                   host: bool = True) -> list[SourceCollector]:
    """The GPU, shm and host collectors that were asked for."""
    sources: list[SourceCollector] = []
    if gpu:
        sources.append(GpuCollector())
    if shm:
        sources.append(ShmCollector(shm_path))
    if host:
        sources.append(HostCollector())
    return sources


def attach(registry: CollectorRegistry, sources: list[SourceCollector]) -> Supervisor:
    """Registers one Supervisor over `sources` (and the self metrics) in `registry`."""
    supervisor = Supervisor(sources)
    registry.register(supervisor)
    return supervisor
