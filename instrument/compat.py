"""Every read of a private torch attribute lives here: read-only, via getattr(..., None).

Checked against torch 2.13.0 (and the 2.x layout since 1.7): a multi-process
DataLoader iterator keeps its worker processes in ``_workers``, a list of
multiprocessing.Process objects. Used only by wrap(), which cannot install the public
worker hooks on a loader it did not build. If the attribute goes away, wrapped loaders
simply report no worker liveness.
"""

from __future__ import annotations

from typing import Any


def worker_pids(iterator: Any) -> list[int]:
    """Pids of a DataLoader iterator's worker processes, or [] when unknown."""
    workers = getattr(iterator, "_workers", None)
    if not isinstance(workers, list):
        return []
    pids = []
    for w in workers:
        pid = getattr(w, "pid", None)
        if isinstance(pid, int) and pid > 0:
            pids.append(pid)
    return pids
