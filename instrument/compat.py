"""Every use of a private torch attribute lives here, via getattr(..., None).

Read-only, but for the tuner's rebuild of a persistent pool (shut_down). Checked against
torch 2.13.0 (and the 2.x layout since 1.7): a multi-process DataLoader iterator keeps
its worker processes in ``_workers``, a list of multiprocessing.Process objects, and a
DataLoader with persistent workers keeps its iterator in ``_iterator``; the worker Process
objects give their exitcode once torch has reaped them (worker_exitcode). Worker pids let
liveness be watched from the first batch on (instrumented workers also report their pid
after their first batch; wrapped loaders have no other source). If an attribute goes away,
wrapped loaders report no worker liveness, and the instrumented loader learns pids one
batch later.
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


def worker_exitcode(iterator: Any, pid: int) -> int | None:
    """multiprocessing's exitcode (-signal, or the exit code) of the iterator's worker
    `pid`, or None. Ask only for a worker known to be dead: reading a live one's
    exitcode would reap it as it ends, before torch's own check."""
    for w in getattr(iterator, "_workers", None) or ():
        if getattr(w, "pid", None) == pid:
            code = getattr(w, "exitcode", None)
            return code if isinstance(code, int) else None
    return None


def persistent_iterator(loader: Any) -> Any:
    """The iterator a persistent-workers DataLoader reuses across epochs, or None.

    torch 2.13 keeps it in ``DataLoader._iterator`` (since 1.7). Only a hint: when it is
    missing, the loader sees the reused iterator by identity after iter() instead.
    """
    return getattr(loader, "_iterator", None)


def base_seed(iterator: Any) -> int:
    """The seed a new pool's base seed is drawn from after the tuner rebuilds one: the old
    iterator's ``_base_seed`` (torch 2.13, since 1.x) plus one, else a fixed 0."""
    seed = getattr(iterator, "_base_seed", None)
    return (seed + 1) % (1 << 63) if isinstance(seed, int) else 0


def shut_down(loader: Any, iterator: Any) -> bool:
    """Ends a persistent-workers loader's pool so that its next iter() builds a new one
    with the loader's current settings (the tuner's change, tuner/loop.py): the one write to
    a private torch attribute. torch 2.13 reuses ``loader._iterator`` while it is set and
    ends its workers with ``_shutdown_workers()`` (its own __del__ calls the same).
    Without them, nothing is done and False is returned: the old pool is left to torch,
    and the tuner leaves the loader's settings as they were."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if not callable(shutdown) or getattr(loader, "_iterator", None) is not iterator:
        return False
    try:
        shutdown()
    finally:  # even a failed shutdown leaves no pool for torch's next iter() to reuse
        loader._iterator = None
    return True


def take_indices(iterator: Any) -> Any:
    """The rest of a map-style iterator's sampler iterator, taken from it: torch 2.13
    draws each batch's indices from ``_sampler_iter`` (since 1.x). The iterator is left an
    empty one, so it hands out what its workers have in flight and then ends, as at the
    end of an epoch. None, and nothing taken, when the attribute is missing."""
    rest = getattr(iterator, "_sampler_iter", None)
    if rest is None:
        return None
    iterator._sampler_iter = iter(())
    return rest


def index_sampler_attr(loader: Any) -> str:
    """The loader attribute torch's iterator takes its indices from (``_index_sampler``):
    the batch sampler with automatic batching, else the sampler."""
    return "batch_sampler" if getattr(loader, "batch_sampler", None) is not None else "sampler"


def give_index_sampler(iterator: Any, sampler: Any) -> None:
    """Sets the sampler a torch iterator reports its length from and draws the next
    epoch's indices from (``_index_sampler``, torch 2.13, since 1.x)."""
    if hasattr(iterator, "_index_sampler"):
        iterator._index_sampler = sampler
