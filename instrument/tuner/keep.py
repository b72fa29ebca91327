"""A tuned loader's worker pool kept across epochs: persistent_workers under the tuner.

Three ways a tuned loader's pools are persistent or not:

- ``torch``: the loader's own persistent_workers, as it was built. A pool the tuner
  rebuilds stays as it was, and keeps the order a reused pool gives (order.fresh_seed).
- ``true``: persistent_workers=true beside num_workers=auto, on a loader built without
  workers (torch refuses the setting without them): every pool the tuner starts is
  persistent.
- ``auto``: persistent_workers=auto (opt-in): the tuner keeps its pool from the next
  iter() on once an epoch's start stalled it (core/tuner/persist.py), where keeping it
  leaves what the loop sees as it is; else it says why, once.

A pool kept where the loader as built would start a new one at every iter() (true, auto)
gives the loop the batches it would give without the tuner: at each iter() that reuses
it, a base seed is drawn from the loader's generator (or torch's RNG) as torch draws one
for a new iterator, so the sampler's order that follows is the same; and each worker is
seeded from it as torch seeds a new worker (compat.WorkerSeed), before the epoch's first
index, then runs the loader's worker_init_fn again where it is one known to do nothing
but seed (Lightning's, Hugging Face Transformers'). The same items, in the same order,
from the same worker.

What auto cannot keep, and says so: a pool whose new start the loop would see differ from
a kept one. A sampler that draws its order when its iterator is built (order.py: a new
iterator builds it twice, a kept one once); an IterableDataset (its stream restarts in new
workers); a worker_init_fn not known to only seed (it runs once per worker start: kept,
it would not run again); a loader class with its own __iter__; a dataset the training
changes between epochs: an attribute assigned (dataset.set_epoch(n)), seen at iter() by
comparing the attributes' values (and those of what it holds, to a few levels) with the
last iter()'s. Not seen: a change inside a large container or an array, or state the
dataset changes in its own workers (a counter, a cache whose items differ): a kept pool
carries it from one epoch to the next where new workers would start afresh. That is why
auto is opt-in.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import BuiltinFunctionType, FunctionType, MethodType, ModuleType
from typing import Any

import torch.utils.data

from dataloader_exporter.core.settings import log_name

from .. import compat
from ..cowscan import attribute_of, members
from ..envsettings import once
from ..torch_originals import MARK, TORCH_ITER, self_timed
from .order import Wrap, lazy_sampler

log = logging.getLogger("dataloader_exporter.instrument")

# worker_init_fns that only seed the worker's RNGs from torch's seed (which a kept pool's
# workers get anew at each epoch): run again at each epoch, as in a new worker.
SEEDING = {("lightning.fabric.utilities.seed", "pl_worker_init_function"),
           ("lightning_fabric.utilities.seed", "pl_worker_init_function"),
           ("pytorch_lightning.utilities.seed", "pl_worker_init_function"),
           ("transformers.trainer_utils", "seed_worker")}
DEPTH = 3  # levels of what the dataset holds whose values are compared at iter()
MOST = 512  # values compared at most
_SCALARS = (int, float, complex, str, bytes, bool, type(None))
_OPAQUE = (type, ModuleType, FunctionType, BuiltinFunctionType, MethodType,
           functools.partial)


def seeding(init_fn: Any) -> bool:
    """Whether a worker_init_fn is one of SEEDING (or a functools.partial of one)."""
    fn = init_fn.func if isinstance(init_fn, functools.partial) else init_fn
    return (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)) in SEEDING


def _walk(dataset: Any) -> list[tuple[Any, Any, int]]:
    """(owner, value, parent entry) of the dataset's attributes and what they hold, to
    DEPTH levels and MOST values, breadth first, none of its code run (cowscan.members)."""
    out: list[tuple[Any, Any, int]] = []
    todo = [(dataset, -1, 0)]
    seen = {id(dataset)}
    while todo and len(out) < MOST:
        obj, parent, depth = todo.pop(0)
        try:
            held = members(obj)
        except Exception:
            continue
        for value, _key in held:
            if len(out) >= MOST:
                break
            out.append((obj, value, parent))
            if (depth + 1 < DEPTH and id(value) not in seen
                    and not isinstance(value, (*_SCALARS, *_OPAQUE, torch.Tensor))
                    and type(value).__module__.split(".")[0] != "numpy"):
                seen.add(id(value))
                todo.append((value, len(out) - 1, depth + 1))
    return out


def _values(walk: list[tuple[Any, Any, int]]) -> list[object]:
    return [(type(v), v) if isinstance(v, _SCALARS) else id(v) for _, v, _ in walk]


def _name(walk: list[tuple[Any, Any, int]], i: int) -> str:
    """The path of entry i: dataset.epoch, dataset.dataset.transform.p."""
    owner, value, parent = walk[i]
    head = "dataset" if parent < 0 else _name(walk, parent)
    return head + attribute_of(owner, value)


class Keeping:
    """One tuned loader's persistent pools (module docstring). mode: "torch", "true" or
    "auto"."""

    def __init__(self, name: str, loader: Any, mode: str) -> None:
        self.name = name
        self.mode = mode
        self.kept = mode == "true"  # its pools are persistent (true, or auto decided)
        self.built = bool(getattr(loader, "persistent_workers", False))  # persistent as built
        self.why_not: str | None = None  # why auto cannot keep it (said once)
        self.final = False  # auto's verdict not to keep it stands (the tuner settled)
        self._print: list[object] | None = None  # the dataset's values at the last iter()
        self._user_init = getattr(loader, "worker_init_fn", None)
        self._init_fn = (self._user_init if self._user_init is not None
                         and seeding(self._user_init) else None)  # run again at each epoch
        own = getattr(type(loader), "__iter__", None)
        # Each epoch's seeds, where the untuned loader would start a new pool each epoch and
        # torch's own __iter__ runs at iter() (a subclass's may run it later, or not at all).
        self.emulate = mode != "torch" and (getattr(own, MARK, own) is TORCH_ITER
                                            or self_timed(loader))
        if mode == "auto":
            self.why_not = self._cannot(loader, own)

    def _cannot(self, loader: Any, own: Any) -> str | None:
        index = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
        if isinstance(loader.dataset, torch.utils.data.IterableDataset):
            return "its IterableDataset's stream starts anew in new workers"
        if not self.emulate:
            return f"its class {type(loader).__qualname__} has its own __iter__"
        if not lazy_sampler(index):
            return (f"its sampler ({type(index).__qualname__}) draws its order when an "
                    "iterator is built, which a kept pool does once per epoch and a new one "
                    "twice")
        init_fn = self._user_init
        if init_fn is not None and self._init_fn is None:
            return (f"its worker_init_fn ({getattr(init_fn, '__qualname__', type(init_fn))}) "
                    "runs at each worker's start, which a kept pool would not repeat")
        return None

    @property
    def deciding(self) -> bool:
        """Whether auto may still decide to keep the pool."""
        return (self.mode == "auto" and not self.kept and self.why_not is None
                and not self.final)

    def decided(self, keep: bool, why: str) -> bool:
        """auto's verdict on the last epoch's pool (core/tuner/persist.py); True when it is
        kept from now on."""
        if not keep:
            log.debug("dataloader %r: persistent_workers stays False: %s",
                      log_name(self.name), why)
            return False
        self.kept = True
        log.warning("dataloader %r: persistent_workers False -> True: %s", log_name(self.name),
                    why)
        return True

    def at_switch(self, loader: Any) -> None:
        """A mid-epoch change of pool (switch.py), its old pool ended: the new one is
        persistent where this loader's pools are kept."""
        if self.mode != "torch":
            want = self.kept and bool(getattr(loader, "num_workers", 0))
            object.__setattr__(loader, "persistent_workers", want)

    def release(self, loader: Any, forget_workers: Callable[[], None]) -> None:
        """The tuner stops or goes back to no workers: a pool it kept is ended, and the
        loader's persistent_workers is as it was built (False), so that no pool is reused
        without its seeds."""
        if self.mode == "torch":
            return
        self.kept = False
        pool = compat.persistent_iterator(loader)
        if pool is not None:
            compat.shut_down(loader, pool)
            forget_workers()
        object.__setattr__(loader, "persistent_workers", False)

    def say_why_not(self) -> None:
        if self.why_not is not None:
            once.problem(f"keep-not:{self.name}", "dataloader %r: persistent_workers=auto "
                         "keeps no pool: %s", log_name(self.name), self.why_not)

    def prepare(self, loader: Any, forget_workers: Callable[[], None]
                ) -> tuple[Wrap | None, str | None]:
        """At iter(), after the tuner's change: the loader's persistent_workers set as its
        pool is to be (never for "torch"), and for a pool reused where the untuned loader
        would start a new one, its workers' seeds. Returns a wrapper of torch's __iter__
        that hands them over (None: nothing to hand over), and the dataset's attribute
        whose change made auto give up keeping it (None)."""
        if self.mode == "torch":
            return None, None
        workers = int(getattr(loader, "num_workers", 0) or 0)
        pool = compat.persistent_iterator(loader)
        changed = None
        if self.mode == "auto" and (self.kept or self.deciding):
            now = _walk(loader.dataset)
            printed, before = _values(now), self._print
            self._print = printed
            if (self.kept and workers and pool is not None and before is not None
                    and printed != before):
                diff = next((i for i, (a, b) in enumerate(zip(printed, before, strict=False))
                             if a != b), min(len(printed), len(before)) - 1)
                changed = _name(now, diff) if 0 <= diff < len(now) else "dataset"
                self.kept = False
                self.why_not = (f"the training changes {changed} between epochs, which "
                                "a kept pool's workers would not see")
        want = self.kept and workers > 0
        if bool(getattr(loader, "persistent_workers", False)) != want:
            if pool is not None:
                compat.shut_down(loader, pool)
                pool = None
            forget_workers()
            object.__setattr__(loader, "persistent_workers", want)  # past torch's guard
        if not (want and pool is not None and self.emulate):
            return None, changed
        if not compat.can_seed(pool):  # its workers cannot be seeded: a new pool instead
            compat.shut_down(loader, pool)
            forget_workers()
            return None, changed
        seed = compat.WorkerSeed(compat.draw_base_seed(loader), self._init_fn)
        return functools.partial(_seeded, pool=pool, seed=seed), changed


def _seeded(torch_iter: Callable[[Any], Any], pool: Any, seed: compat.WorkerSeed
            ) -> Callable[[Any], Any]:
    """torch_iter that hands `seed` to the reused pool's workers (compat.resume_with_seed)."""
    def it(loader: Any) -> Any:
        compat.resume_with_seed(pool, seed)
        try:
            return torch_iter(loader)
        finally:
            compat.clear_seed(pool)
    return it
