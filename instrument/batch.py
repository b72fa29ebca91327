"""Walking a batch: its sample count, its tensor bytes, moving it to a device.

Batches are nested tuples, lists, dicts, namedtuples and dataclasses of tensors, as
DataLoader's default collate builds them; anything else is passed through untouched.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

Tensor = torch.Tensor


def batch_len(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor (1 if none)."""
    # Fast path for default_collate's output, a list or tuple whose first item is a batched
    # tensor: shape[0] costs ~90 ns where the general walk below costs ~350 ns.
    t = type(batch)
    if (t is list or t is tuple) and batch:
        first = batch[0]
        if type(first) is Tensor:
            shape = first.shape
            return int(shape[0]) if shape else 1
    for _ in range(8):
        t = type(batch)
        if t is Tensor:
            shape = batch.shape
            return int(shape[0]) if shape else 1
        if t is tuple or t is list:
            if not batch:
                return 0
            batch = batch[0]
        elif t is dict:
            if not batch:
                return 0
            batch = next(iter(batch.values()))
        elif isinstance(batch, Tensor):
            shape = batch.shape
            return int(shape[0]) if shape else 1
        elif isinstance(batch, Mapping):
            if not batch:
                return 0
            batch = next(iter(batch.values()))
        elif isinstance(batch, (tuple, list)):
            if not batch:
                return 0
            batch = batch[0]
        elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
            fields = dataclasses.fields(batch)
            if not fields:
                return 1
            batch = getattr(batch, fields[0].name)
        else:
            return 1
    return 1


def batch_nbytes(batch: Any) -> int:
    """Bytes of all tensors in a (nested) batch."""
    total = 0

    def visit(t: Tensor) -> Tensor:
        nonlocal total
        total += t.nbytes
        return t

    _walk(batch, visit, rebuild=False)
    return total


def _walk(obj: Any, fn: Callable[[Tensor], Any], rebuild: bool = True) -> Any:
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, (str, bytes)):
        return obj
    if isinstance(obj, Mapping):
        items = {k: _walk(v, fn, rebuild) for k, v in obj.items()}
        if not rebuild:
            return obj
        try:  # keep the mapping's own type (OrderedDict, defaultdict, UserDict...)
            clone: Any = copy.copy(obj)
            clone.update(items)
            return clone
        except Exception:
            return items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        moved = [_walk(v, fn, rebuild) for v in obj]
        return type(obj)(*moved) if rebuild else obj
    if isinstance(obj, (tuple, list)):
        moved = [_walk(v, fn, rebuild) for v in obj]
        if not rebuild:
            return obj
        try:
            return type(obj)(moved)
        except TypeError:
            return moved
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _walk(getattr(obj, f.name), fn, rebuild)
                   for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes) if rebuild else obj
    return obj


def move(batch: Any, device: torch.device, non_blocking: bool) -> tuple[Any, int]:
    """The batch with every tensor on `device`, and the bytes that changed device."""
    moved = 0

    def to(t: Tensor) -> Tensor:
        nonlocal moved
        if t.device != device:
            moved += t.nbytes
        return t.to(device, non_blocking=non_blocking)

    return _walk(batch, to), moved
