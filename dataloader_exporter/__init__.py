"""dataloader-exporter: Prometheus metrics, Grafana dashboards and a doctor for PyTorch
input pipelines, in one namespace.

    from dataloader_exporter import DataLoader   # instead of torch.utils.data.DataLoader

The drop-in (``DataLoader``, ``wrap``, ``to_device``, ``serve``, ...) is loaded on first
use, so that the sidecar, the doctor and the dashboards, which import this package too,
never import torch. The packages: ``core`` (stdlib-only: the metric catalogue, machine
facts, settings, bands), ``exporter`` (collectors and HTTP, never torch), ``instrument``
(the trainer side), ``diagnosis`` (doctor and top) and ``dashboards`` (grafanalib).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The instrumentation's public names, served from dataloader_exporter.instrument.
_DROP_IN = ("DataLoader", "WrappedLoader", "default_registry", "serve", "shutdown",
            "to_device", "wrap", "write_snapshots")

if TYPE_CHECKING:
    from dataloader_exporter.instrument import (  # type: ignore[no-redef]  # noqa: F401
        DataLoader,
        WrappedLoader,
        default_registry,
        serve,
        shutdown,
        to_device,
        wrap,
        write_snapshots,
    )


def __getattr__(name: str) -> Any:
    if name in _DROP_IN:
        return getattr(importlib.import_module("dataloader_exporter.instrument"), name)
    raise AttributeError(f"module 'dataloader_exporter' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_DROP_IN])


__all__ = ["__version__", *_DROP_IN]
