"""In-process serving: the trainer's own registry over HTTP, one call.

The hub of the registry owns the servers and attaches the exporter's GPU, /dev/shm and
host collectors (once), so a single-process user gets everything the sidecar would
serve, without one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataloader_exporter.core.facts.shm import SHM_PATH

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from dataloader_exporter.exporter.web.server import ServerHandle

from .hub import hub_for


def serve(port: int = 0, addr: str = "0.0.0.0", registry: CollectorRegistry | None = None,
          system_metrics: bool = True, shm_path: str = SHM_PATH,
          web_config_file: str | None = None) -> ServerHandle:
    """Serves the loaders' metrics on addr:port (once per address; 0 = any free port).

    system_metrics adds the GPU (NVML), /dev/shm and host memory collectors;
    web_config_file (exporter-toolkit's format, as the sidecar's --web.config.file)
    turns on TLS and basic auth. Raises OSError when the port is taken and ValueError
    for a bad web config: an explicit call deserves an explicit error.
    """
    return hub_for(registry).serve(port, addr, system_metrics, shm_path, web_config_file)


def shutdown(registry: CollectorRegistry | None = None) -> None:
    """Stops the servers and snapshot threads of a registry's hub (default: the process's),
    after writing a last snapshot; the metrics themselves stay in the registry."""
    hub_for(registry).close()
