"""Instrumentation for PyTorch DataLoaders: change one import line.

    from dataloader_exporter import DataLoader          # instead of torch.utils.data.DataLoader
    loader = DataLoader(ds, batch_size=64, num_workers=4, name="train")

or, for a loader built elsewhere, ``loader = dataloader_exporter.wrap(loader,
name="train")``; or no code at all: ``dataloader-exporter run -- COMMAND`` (zero-code mode,
zerocode/hooks.py). Metrics go to snapshot files (metrics_dir= or $DATALOADER_EXPORTER_DIR)
for the sidecar exporter, and/or are served in-process (port= or dataloader_exporter.serve()).

The per-batch code lives in the hotpath_*.py modules; iter_start.py builds the iterator
the loop takes; instruments.py holds what a loader does less often than once a batch.
Importing it loads what building a loader and taking its batches needs; prometheus_client,
the snapshot writer, the tuner and the HTTP server are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .hub import default_registry, hub_for
from .loader import DataLoader, WrappedLoader, to_device, wrap
from .serve import serve, shutdown

if TYPE_CHECKING:
    from .snapshot_writer import SnapshotWriter


def write_snapshots(directory: str, interval: float = 1.0) -> SnapshotWriter:
    """Writes the default registry's metrics to <directory>/<unique>.prom every interval."""
    return hub_for().write_snapshots(directory, interval)


__all__ = [
    "DataLoader",
    "WrappedLoader",
    "default_registry",
    "serve",
    "shutdown",
    "to_device",
    "wrap",
    "write_snapshots",
]
