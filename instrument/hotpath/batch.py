"""Walking a batch: its sample count, its tensor bytes, moving it to a device.

Batches are nested tuples, lists, dicts, namedtuples and dataclasses of tensors, as
DataLoader's default collate builds them; anything else is passed through untouched.

Samples in a batch, by who made it (chosen once per iterator, iter_start.counter_for):

- collated_len: torch's default_collate, whose output has the shape of one sample with a
  batch dimension added: the first column reached through dicts and sequences is a
  tensor whose first dimension is the batch, or a list of strings or bytes as long as
  the batch. Exact by construction.
- batch_len: a custom collate_fn's batch, whose count is then checked against the
  samples the collate_fn was given (workerblock.py): the length its fields
  (columns) agree on, where a field's length is a tensor's or array's first dimension, a
  list's or tuple's length, or a nested record's own count; fields that disagree make it
  unknown.
  A list of records (rows: dicts, or tuples whose items differ in kind, as a collate_fn
  that returns its samples gives them) counts its records.
- loader_len: an item of a loader we time from the outside (wrap() of something that is
  not a torch DataLoader, webdataset's rebatching): a batch by contract, so a lone
  tensor counts its first dimension; otherwise as batch_len, with nothing to check it.
- item_len (batch_size=None: items as the dataset yields them, batches or single
  samples): counted only on evidence of a batch: rows, or at least two fields that
  agree and differ in kind (a tensor beside one of more dimensions, or beside a list of
  strings: webdataset's keys). A lone tensor, or same-shaped fields (input_ids and
  attention_mask of one sample), may be one sample as well as a batch: unknown.

A number, a string, a 0-d tensor or a record of nothing else is one sample; such a
scalar beside batched fields (a batch's metadata) is not a field.

Unknown is None, never a guess: the caller then exports no sample count.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

Tensor = torch.Tensor
_LEAVES = (str, bytes, int, float, complex)  # bool is an int
MAX_DEPTH = 8  # levels of nesting walked before a count is given up as unknown


def _dim0(x: Any) -> int | None:
    shape = x.shape
    return int(shape[0]) if len(shape) else None


def collated_len(batch: Any) -> int | None:
    """Samples in a batch torch's default_collate made (see the module docstring)."""
    # Fast path: a list or tuple whose first item is a batched tensor (about 90 ns where
    # the walk below costs about 350 ns).
    t = type(batch)
    if (t is list or t is tuple) and batch and type(batch[0]) is Tensor:
        shape = batch[0].shape
        return int(shape[0]) if shape else None
    for _ in range(MAX_DEPTH):
        if isinstance(batch, (Tensor, np.ndarray)):
            return _dim0(batch)
        if isinstance(batch, Mapping):
            if not batch:
                return None
            batch = next(iter(batch.values()))
        elif isinstance(batch, (tuple, list)):
            if not batch:
                return None
            first = batch[0]
            if isinstance(first, _LEAVES):  # a column of strings (or numbers): one per sample
                return len(batch)
            batch = first
        elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
            fields = dataclasses.fields(batch)
            if not fields:
                return None
            batch = getattr(batch, fields[0].name)
        else:
            return None
    return None


def batch_len(batch: Any) -> int | None:
    """Samples in a custom collate_fn's batch (module docstring)."""
    return _count(batch, lone=True, evidence=False, depth=MAX_DEPTH)


# An item of a loader timed from the outside is counted as a custom collate_fn's batch,
# with nothing to check it against (module docstring).
loader_len = batch_len


def item_len(item: Any) -> int | None:
    """Samples in an item a dataset yielded with batch_size=None (module docstring)."""
    return _count(item, lone=False, evidence=True, depth=MAX_DEPTH)


def _fields(x: Any) -> list[Any] | None:
    """The fields of a record-like batch, or None for anything else."""
    if isinstance(x, Mapping):
        return list(x.values())
    if isinstance(x, (tuple, list)):
        return list(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [getattr(x, f.name) for f in dataclasses.fields(x)]
    return None


def _scalar(x: Any) -> bool:
    return isinstance(x, _LEAVES) or (isinstance(x, (Tensor, np.ndarray)) and not len(x.shape))


def _is_record(x: Any) -> bool:
    return isinstance(x, Mapping) or (dataclasses.is_dataclass(x) and not isinstance(x, type))


def _rows(x: Any) -> bool:
    """A plain list or tuple of records (one per sample), not of columns: all dicts or
    dataclasses, or all sequences of one length whose items differ in kind, like (str,
    tensor, int) samples (the columns of a zip(*samples) are of one kind each)."""
    if not isinstance(x, (tuple, list)) or hasattr(x, "_fields") or not x:
        return False
    if all(_is_record(r) for r in x):
        return True
    return all(isinstance(r, (tuple, list)) for r in x) and len({len(r) for r in x}) == 1 and (
        all(len({type(v) for v in r}) > 1 for r in x))


def _kind(x: Any) -> object:
    """What a field is, to tell a batch's columns from one sample's same-shaped parts."""
    if isinstance(x, (Tensor, np.ndarray)):
        return len(x.shape)
    return "list" if isinstance(x, (tuple, list)) and not hasattr(x, "_fields") else "record"


def _field_len(x: Any, depth: int) -> int | None:
    if isinstance(x, (Tensor, np.ndarray)):
        return _dim0(x)
    if isinstance(x, (tuple, list)) and not hasattr(x, "_fields"):
        return len(x)  # a column: one entry per sample
    if depth <= 0:
        return None
    return _count(x, lone=True, evidence=False, depth=depth - 1)  # a nested record


def _count(batch: Any, lone: bool, evidence: bool, depth: int) -> int | None:
    """lone: a lone tensor or column counts its length; evidence: fields must show a
    batch (module docstring)."""
    if _scalar(batch):
        return 1  # a number or string: one sample, never a batch of them
    if isinstance(batch, (Tensor, np.ndarray)):
        return _dim0(batch) if lone else None
    if _rows(batch):
        return len(batch)
    if isinstance(batch, (tuple, list)) and batch and not hasattr(batch, "_fields") and (
            isinstance(batch[0], _LEAVES)):
        return len(batch) if lone else None  # a lone column of strings or numbers
    fields = _fields(batch)
    if not fields:
        return None
    if all(_scalar(f) for f in fields):
        return 1  # a record of numbers and strings: one sample
    found: int | None = None
    kinds = set()
    for f in fields:
        n = None if _scalar(f) else _field_len(f, depth)  # a scalar beside a batch: metadata
        if n is None:
            continue
        if found is not None and n != found:
            return None  # fields that disagree: not a batch we can count
        found = n
        kinds.add(_kind(f))
    if evidence and len(kinds) < 2:
        return None
    return found


def batch_nbytes(batch: Any) -> int:
    """Bytes of all tensors in a (nested) batch."""
    t = type(batch)
    if t is list or t is tuple:  # default_collate's usual batch: a flat list of tensors
        flat = 0
        for x in batch:
            if type(x) is not Tensor:
                break
            flat += x.nbytes
        else:
            return flat
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
