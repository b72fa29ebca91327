"""In-process serving: the trainer's own registry over HTTP, one call.

The exporter's GPU, /dev/shm and host collectors attach to the same registry (once),
so a single-process user gets everything the sidecar would serve, without one.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry

from exporter.http import ServerHandle
from exporter.http import serve as _serve
from exporter.sources import attach, system_sources

from .env import SHM_PATH
from .hub import hub_for

_servers: dict[tuple[str, int], tuple[ServerHandle, CollectorRegistry]] = {}
_with_system: set[int] = set()
_lock = threading.Lock()


def serve(port: int = 0, addr: str = "0.0.0.0", registry: CollectorRegistry | None = None,
          system_metrics: bool = True, shm_path: str = SHM_PATH) -> ServerHandle:
    """Serves the loaders' metrics on addr:port (once per address; 0 = any free port).

    system_metrics adds the GPU (NVML), /dev/shm and host memory collectors.
    Raises OSError when the port is taken: an explicit call deserves an explicit error.
    """
    reg = hub_for(registry).registry
    with _lock:
        known = _servers.get((addr, port)) if port else None
        if known is not None and not known[0].closed:
            handle, served = known
            if served is not reg:
                raise OSError(f"{addr}:{port} already serves another registry")
            return handle
        handle = _serve(reg, addr, port)
        _servers[(addr, handle.port)] = (handle, reg)
        if system_metrics and id(reg) not in _with_system:
            _with_system.add(id(reg))
            attach(reg, system_sources(shm_path))
        return handle
