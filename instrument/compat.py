"""Every read of a private torch attribute lives here: read-only, via getattr(..., None).

Checked against torch 2.13.0 (and the 2.x layout since 1.7): a multi-process
DataLoader iterator keeps its worker processes in ``_workers``, a list of
multiprocessing.Process objects, and a DataLoader with persistent workers keeps its
iterator in ``_iterator``. Worker pids let liveness be watched from the first batch on
(instrumented workers also report their pid after their first batch; wrapped loaders
have no other source). If an attribute goes away, wrapped loaders report no worker
liveness, and the instrumented loader learns pids one batch later.
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


def persistent_iterator(loader: Any) -> Any:
    """The iterator a persistent-workers DataLoader reuses across epochs, or None.

    torch 2.13 keeps it in ``DataLoader._iterator`` (since 1.7). Only a hint: when it is
    missing, the loader sees the reused iterator by identity after iter() instead.
    """
    return getattr(loader, "_iterator", None)
