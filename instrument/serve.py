"""In-process serving: the trainer's own registry over HTTP, one call."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry

from exporter.http import ServerHandle
from exporter.http import serve as _serve

from .hub import hub_for

_servers: dict[tuple[str, int], tuple[ServerHandle, CollectorRegistry]] = {}
_lock = threading.Lock()


def serve(port: int = 0, addr: str = "0.0.0.0",
          registry: CollectorRegistry | None = None) -> ServerHandle:
    """Serves the loaders' metrics on addr:port (once per address; 0 = any free port).

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
        return handle
