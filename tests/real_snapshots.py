"""Real trainer snapshot files, written by instrument's own SnapshotWriter."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from helpers import SleepDataset
from prometheus_client import CollectorRegistry

from dataloader_exporter import instrument
from dataloader_exporter.instrument.hub import hub_for

# (loader name, num_workers); 0 workers gives a file without per-worker series.
Loaders = Sequence[tuple[str, int]]


def real_snapshot(rank: str = "0", loaders: Loaders = (("t", 2),), batches: int = 4,
                  to_device_first: str | None = None, exited: bool = False) -> bytes:
    """What a trainer process of `rank` running `loaders` writes to its snapshot file.

    to_device_first names a loader whose to_device() runs before it is ever iterated
    (its recorder then exists without a configuration, as in a real program).
    exited: the last snapshot of a process that exits normally (its exit hook ran);
    otherwise one written while it runs, or the last before a kill.
    """
    saved = os.environ.get("RANK")
    os.environ["RANK"] = rank
    # no advice in test logs
    logging.getLogger("dataloader_exporter.instrument").setLevel(logging.ERROR)
    try:
        registry = CollectorRegistry()
        for name, workers in loaders:
            loader = instrument.DataLoader(SleepDataset(batches), batch_size=1, name=name,
                                           num_workers=workers, registry=registry)
            if name == to_device_first:
                loader.to_device(SleepDataset(1)[0][0], "cpu")
                continue
            for x, _ in loader:
                loader.to_device(x, "cpu")
        with tempfile.TemporaryDirectory() as directory:
            writer = hub_for(registry).write_snapshots(directory, interval=3600)
            if exited:
                hub_for(registry).exiting()
            writer.close()  # stops the thread after one last write
            return Path(writer.path).read_bytes()
    finally:
        logging.getLogger("dataloader_exporter.instrument").setLevel(logging.NOTSET)
        if saved is None:
            os.environ.pop("RANK", None)
        else:
            os.environ["RANK"] = saved
