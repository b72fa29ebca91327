"""Real trainer snapshot files for the scrape benchmark, made by the real instrumentation.

Each rank gets its own registry (as each trainer process has its own), holding one
instrument.DataLoader per loader name; every loader runs a few batches, and the rank's
registry is written once, with generate_latest, to ``<dir>/rank<r>.prom``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

LOADERS = ("train", "val", "aux", "test")
# Loaders that run with worker processes, so the files carry per-worker series too.
WITH_WORKERS = {"train": 2, "aux": 2}


def write_rank_files(directory: Path, ranks: int = 8, loaders: Sequence[str] = LOADERS,
                     batches: int = 8) -> list[Path]:
    """Writes one snapshot file per rank; returns their paths."""
    import torch
    from prometheus_client import CollectorRegistry, generate_latest

    from dataloader_exporter import instrument

    # Preflight advice ("num_workers=0 ...") is meant for users, not for this benchmark.
    quiet = logging.getLogger("dataloader_exporter.instrument")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    data = torch.arange(batches * 4 * 2, dtype=torch.float32).reshape(batches * 4, 2)
    dataset = torch.utils.data.TensorDataset(data)
    paths = []
    saved = os.environ.get("RANK")
    try:
        for rank in range(ranks):
            os.environ["RANK"] = str(rank)  # instrument.rank.current_rank() reads $RANK
            registry = CollectorRegistry()
            for name in loaders:
                loader = instrument.DataLoader(dataset, batch_size=4, name=name,
                                               num_workers=WITH_WORKERS.get(name, 0),
                                               registry=registry)
                for _ in loader:
                    pass
            path = directory / f"rank{rank}.prom"
            tmp = directory / f".rank{rank}.tmp"
            tmp.write_bytes(generate_latest(registry))
            os.replace(tmp, path)
            paths.append(path)
    finally:
        quiet.setLevel(level)
        if saved is None:
            os.environ.pop("RANK", None)
        else:
            os.environ["RANK"] = saved
    return paths
