"""Every use of a private torch attribute lives here, via getattr(..., None).

Read-only, but for the tuner's rebuild of a persistent pool (shut_down), the seed it
gives a pool it keeps (resume_with_seed, reseed_worker) and a kept pool's queue depth
(deepen). Checked against
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


def deepen(iterator: Any, prefetch: int) -> bool:
    """Sets the batches per worker a persistent iterator keeps in flight from its next
    iter() on, its pool kept: torch 2.13 primes and refills its queue from
    ``_prefetch_factor`` (since 1.7), read at each _reset() and batch. False, and nothing
    set, where the attribute is missing (the pool is then rebuilt)."""
    if not isinstance(getattr(iterator, "_prefetch_factor", None), int) or prefetch < 1:
        return False
    iterator._prefetch_factor = prefetch
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


def draw_base_seed(loader: Any) -> int:
    """A base seed drawn as torch 2.13's new iterator draws its ``_base_seed`` (since 1.x):
    one int64 from the loader's generator, or torch's global RNG without one."""
    import torch

    return int(torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item())


class WorkerSeed:
    """What torch's ``_ResumeIteration`` carries to a kept pool's workers in its ``seed``
    field (unused for a map-style dataset): unpickled in each worker, before the epoch's
    first index, it seeds the worker as torch seeds a new one (reseed_worker) and becomes
    None, the seed torch itself sends."""

    def __init__(self, base_seed: int, init_fn: Any = None) -> None:
        self.base_seed = base_seed
        self.init_fn = init_fn

    def __reduce__(self) -> tuple[Any, tuple[int, Any]]:
        return reseed_worker, (self.base_seed, self.init_fn)


def reseed_worker(base_seed: int, init_fn: Any = None) -> None:
    """In a worker: its RNGs seeded as torch 2.13's _worker_loop seeds a new worker
    (random and torch from base_seed + id, numpy from _generate_state), its WorkerInfo's
    seed set to match, then init_fn(id) as torch calls a worker_init_fn. Returns None."""
    import random

    import torch
    from torch.utils.data._utils import worker

    info = worker._worker_info
    if info is None:
        return None
    seed = base_seed + info.id
    random.seed(seed)
    manual_seed(torch, seed)
    if getattr(worker, "HAS_NUMPY", False):
        import numpy as np

        np.random.seed(worker._generate_state(base_seed, info.id))
    object.__setattr__(info, "seed", seed)  # a frozen dataclass, as torch made it
    if init_fn is not None:
        init_fn(info.id)
    return None


# The names torch 2.13's torch.manual_seed and random._manual_seed_impl use: the CUDA, MPS,
# XPU and MTIA generators, a custom device's, then the CPU one. Another name means another
# backend to seed: manual_seed then leaves the seeding to torch.
_SEEDS = frozenset({"_manual_seed_impl", "int", "torch", "torch.cuda", "torch.mps",
                    "torch.xpu", "torch.mtia", "cuda", "mps", "xpu", "mtia",
                    "_is_in_bad_fork", "manual_seed_all", "manual_seed",
                    "_seed_custom_device", "default_generator"})
# The lazy backends to seed, decided at the first call; None: torch.manual_seed seeds.
_lazy_seeds: list[Any] | None = None
_decided = False


def manual_seed(torch: Any, seed: int) -> None:
    """torch.manual_seed(seed) in effect, without its cost for a device backend this build
    lacks: a lazy backend (CUDA, XPU, MTIA) queues its seeding for its first use, with a
    formatted traceback (~100 µs each in a worker), and its first use raises unless the
    build has it, so the queued call can never run. Backends the build has are seeded as
    torch seeds them; torch.manual_seed itself where its seeding names anything else."""
    global _lazy_seeds, _decided
    if not _decided:
        _lazy_seeds = lazy_backends(torch) if torch_seeds_known(torch) else None
        _decided = True
    if _lazy_seeds is None:
        torch.manual_seed(seed)
        return
    for backend in _lazy_seeds:
        if not backend._is_in_bad_fork():
            backend.manual_seed_all(seed)
    torch.mps.manual_seed(seed)  # returns at once on a build without MPS
    torch.random._seed_custom_device(seed)
    torch.default_generator.manual_seed(seed)


def torch_seeds_known(torch: Any) -> bool:
    """Whether torch.manual_seed names only what manual_seed knows (_SEEDS)."""
    names: set[str] = set()
    for fn in (torch.manual_seed, getattr(torch.random, "_manual_seed_impl", None)):
        code = getattr(fn, "__code__", None)
        if code is None:
            return False
        names.update(code.co_names)
    return names <= _SEEDS


def lazy_backends(torch: Any) -> list[Any]:
    """The lazily initialised device modules (torch.cuda, .xpu, .mtia) this build has."""
    import torch.mps  # manual_seed seeds it too
    import torch.mtia
    import torch.xpu

    built = (("cuda", hasattr(torch._C, "_cuda_getDeviceCount")),
             ("xpu", bool(getattr(torch._C, "_has_xpu", True))),
             ("mtia", bool(getattr(torch._C, "_mtia_isBuilt", lambda: True)())))
    return [getattr(torch, name) for name, has in built if has]


def can_seed(iterator: Any) -> bool:
    """Whether resume_with_seed can hand a seed to this persistent iterator's workers:
    torch 2.13's _reset() sends ``self._shared_seed`` with its ``_ResumeIteration``, None
    for a map-style dataset (since 1.11)."""
    now = getattr(iterator, "_shared_seed", False)
    return (now is None or isinstance(now, WorkerSeed)) and callable(
        getattr(iterator, "_reset", None))


def resume_with_seed(iterator: Any, seed: WorkerSeed) -> None:
    """Makes the next _reset() of a persistent iterator send `seed` to its workers (see
    can_seed)."""
    iterator._shared_seed = seed


def clear_seed(iterator: Any) -> None:
    """The iterator's ``_shared_seed`` back to None once its workers have theirs."""
    if isinstance(getattr(iterator, "_shared_seed", None), WorkerSeed):
        iterator._shared_seed = None
