"""Worker processes report to their main process through a small shared-memory block.

How the block reaches the workers, and why only this way. torch hands a worker four
objects of ours: the dataset, the sampler's indices, ``worker_init_fn`` and ``collate_fn``.
torch and users branch on the dataset's type (``IterDataPipe`` sharding and reseeding,
``IterableDataset``, ``isinstance(get_worker_info().dataset, MyDataset)``), so the dataset
is never replaced, not even for the workers, and ``worker_init_fn`` is left alone too.
What remains is ``collate_fn``, a plain callable that torch calls once per batch in the
worker and never inspects. While the iterator starts its workers it sees a
``TimedCollate`` around the user's function; ``loader.collate_fn`` is the user's again
before ``iter()`` returns.

At the end of each batch a worker writes into its row of an int64 block: the process's
CPU time so far, samples collated, the wall time (ns) and its pid. How long a worker
spent fetching samples (wall time, I/O included) cannot be known without wrapping the
dataset, so it is not measured: CPU time is what is exported. One block belongs to one
torch iterator (one generation of workers); when that iterator is collected its workers
are gone, and the block's figures are folded into per-worker totals and released.

The main process reads the blocks at most once a second, off the per-batch path
(tracker.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import get_worker_info

CPU, SAMPLES, HEARTBEAT, PID = range(4)
_FIELDS = 4


def new_block(num_workers: int) -> torch.Tensor:
    """A zeroed [num_workers, 4] int64 block in shared memory."""
    return torch.zeros((num_workers, _FIELDS), dtype=torch.int64).share_memory_()


class TimedCollate:
    """The user's collate_fn, plus one row update per batch when called in a worker."""

    def __init__(self, collate_fn: Callable[[Any], Any], block: torch.Tensor,
                 batched: bool) -> None:
        self.collate_fn = collate_fn
        self.block = block
        self.batched = batched  # auto-collation: `data` is a list of samples
        self._row: Any = None  # this process's row; False where there is none

    def __getstate__(self) -> dict[str, Any]:
        return {"collate_fn": self.collate_fn, "block": self.block, "batched": self.batched,
                "_row": None}

    def __call__(self, data: Any) -> Any:
        out = self.collate_fn(data)
        row = self._row
        if row is None:
            row = self._row = self._bind()
        if row is not False:
            # A __getitems__ may return something without len(): then no samples are added.
            row[SAMPLES] += (len(data) if hasattr(data, "__len__") else 0) if self.batched else 1
            row[CPU] = time.process_time_ns()
            row[HEARTBEAT] = time.time_ns()
        return out

    def _bind(self) -> Any:
        try:
            info = get_worker_info()
            if info is None:
                return False
            row = self.block.numpy()[info.id]
            row[PID] = os.getpid()
            return row
        except Exception:  # metrics must never stop a worker
            return False
