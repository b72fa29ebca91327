"""The order of a tuned loader's batches, kept as it would be without the tuner.

A change of worker count or a rebuilt persistent pool must not change which batches the
loop sees, nor in what order. Map-style batches come in the same order whatever the
worker count, but two things can still shift it: a sampler that draws its order when
its iterator is built (order_bound: the tuner then only advises), and the base seed a
new iterator draws from the loader's generator (fresh_seed: drawn from a generator of
its own instead).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.data
import torch.utils.data.distributed

TorchIter = Callable[[Any], Any]  # a loader's own __iter__ (torch's, or a subclass's)
Wrap = Callable[[TorchIter], TorchIter]  # what the tuner wraps it in for one iter()


def order_bound(loader: Any, workers: int) -> str | None:
    """Why a new worker pool would change the order of this loader's batches, or None.

    torch builds the sampler's iterator once in a single-process iterator and twice in a
    multi-process one (and once more at each epoch of a persistent pool). A sampler whose
    __iter__ is a generator function draws its order lazily, at the first index: the
    count does not matter. One that draws it when the iterator is built (torchdata's
    StatefulDataLoader samplers, a custom __iter__ returning iter(list)) consumes its
    generator once more per build: going from no workers to some, or rebuilding a
    persistent pool, would change the order, tuner or person alike."""
    index = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    if lazy_sampler(index):
        return None
    if workers and not getattr(loader, "persistent_workers", False):
        return None  # among worker counts of 1 and more (never 0: see core/tuner/rules.py)
    pool = "rebuilding its persistent workers" if workers else "starting workers"
    return (f"its sampler ({type(index).__qualname__}) draws its order when an iterator is "
            f"built, so {pool} would change the order of the batches")


def lazy_sampler(sampler: Any, depth: int = 0) -> bool:
    """Whether building the sampler's iterator draws nothing: its __iter__ is a generator
    function; torch's SequentialSampler and DistributedSampler (no shared RNG: the
    latter seeds its own from seed + epoch); or Accelerate's shard of a batch sampler,
    whose __iter__ returns its own generator over the sampler it holds, lazy if that is."""
    if inspect.isgeneratorfunction(getattr(type(sampler), "__iter__", None)):
        return True
    if isinstance(sampler, (torch.utils.data.SequentialSampler,
                            torch.utils.data.distributed.DistributedSampler)):
        return True
    inner = getattr(sampler, "batch_sampler", None)
    return (depth < 3 and inner is not None
            and type(sampler).__module__.startswith("accelerate.")
            and lazy_sampler(inner, depth + 1))


def fresh_seed(torch_iter: Callable[[Any], Any], seed: int) -> Callable[[Any], Any]:
    """torch_iter for a persistent pool rebuilt by the tuner: torch's new iterator draws
    its base seed from a generator of its own (seeded from the old pool's), not from the
    loader's, so the loader's generator (and the sampler order it drives) advances as if
    the old pool had been reused."""
    def it(loader: Any) -> Any:
        user = loader.generator
        own = torch.Generator()
        own.manual_seed(seed)
        loader.generator = own
        try:
            return torch_iter(loader)
        finally:
            loader.generator = user
    return it
