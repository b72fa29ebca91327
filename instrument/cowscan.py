"""The dataset's large containers of Python objects, which forked workers copy as they
read them (copy-on-read), found once before a loader's first pool of workers starts.

A worker shares its parent's memory copy-on-write; reading an object writes its reference
count, so a worker that reads the items of a list of 3,000,000 paths copies the pages
they sit on, and each worker ends up with its own copy (memgrowth.py sees it grow). A
numpy array, a pyarrow array or a tensor holds its items in one buffer with one reference
count: nothing is copied.

What is looked at: the dataset's attributes, the attributes of the datasets it wraps
(torch's Subset and ConcatDataset, or any Dataset held as an attribute, up to MAX_DEPTH),
and the items of a small list, tuple or dict among them (a dict of lists). A list, tuple,
dict, object-dtype numpy array or pandas object of MIN_OBJECTS items or more is a
container, reported with its path (dataset.paths, dataset.dataset.samples,
dataset.datasets[0].paths, dataset.index['paths']), its type, its items' type, their
count and an estimate of their size from a sample of SAMPLE items.

What looking costs the training: nothing it can see. An instance's attributes are reached
with gc.get_referents, which does not make its __dict__ (in CPython 3.11, asking for an
instance's __dict__ slows every later attribute read of it about threefold); the
__dict__ is read only to name a container found. A container's items are not touched but
its sample (their reference counts written once in the parent, before the fork). numpy
and pandas objects are recognised by their type's module, never imported. The scan
stops after SCAN_BUDGET seconds, with what it found so far.
"""

from __future__ import annotations

import gc
import itertools
import sys
from dataclasses import dataclass
from time import perf_counter
from typing import Any, NamedTuple

import torch

MIN_OBJECTS = 100_000  # items of a container worth naming (about 10 MB of str)
SAMPLE = 16  # items whose size is read, evenly spread
SMALL = 16  # a list, tuple or dict this small is looked into, one level
MAX_DEPTH = 3  # datasets within datasets looked into
SCAN_BUDGET = 0.01  # seconds
MOST = 3  # containers reported per loader, the largest by size


@dataclass(frozen=True)
class Container:
    """A large container of Python objects held by the dataset."""

    attribute: str  # its path from the dataset: dataset.paths
    container: str  # its type: list, tuple, dict, ndarray, DataFrame, Series
    item: str  # its items' type (a dict's key:value), or mixed
    objects: int  # items (a DataFrame's: its object cells)
    bytes: int  # estimated: the container and its items


class _Node(NamedTuple):
    obj: Any
    parent: _Node | None
    key: str | None  # "[0]" or "['paths']"; None: an attribute, named when needed
    depth: int


def scan(dataset: Any, budget: float = SCAN_BUDGET) -> tuple[Container, ...]:
    """The MOST largest containers found in `dataset` within `budget` seconds."""
    deadline = perf_counter() + budget
    found: list[Container] = []
    todo = [_Node(dataset, None, None, 0)]
    seen = {id(dataset)}
    while todo and perf_counter() < deadline:
        node = todo.pop(0)
        for value, key in _members(node.obj):
            if id(value) in seen:
                continue
            seen.add(id(value))
            child = _Node(value, node, key, node.depth + 1)
            measured = _measure(value)
            if measured is not None:
                found.append(Container(_path(child), *measured))
            elif isinstance(value, torch.utils.data.Dataset) and child.depth <= MAX_DEPTH:
                todo.append(child)
            elif key is None and type(value) in (list, tuple, dict) and len(value) <= SMALL:
                todo.append(child)  # a dict of lists, a list of datasets: their items
    found.sort(key=lambda c: -c.bytes)
    return tuple(found[:MOST])


def _members(obj: Any) -> list[tuple[Any, str | None]]:
    """An object's attribute values (key None), or a small container's items (with their
    key), without making an instance's __dict__."""
    if type(obj) in (list, tuple):
        return [(v, f"[{i}]") for i, v in enumerate(obj)]
    if type(obj) is dict:
        return [(v, f"[{k!r}]") for k, v in obj.items()]
    cls = type(obj)
    out: list[tuple[Any, str | None]] = []
    for v in gc.get_referents(obj):
        if v is cls:
            continue
        if _instance_dict(obj, v):  # made already: its values are the attributes
            out += [(x, None) for x in v.values()]
        else:
            out.append((v, None))
    return out


def _instance_dict(obj: Any, d: Any) -> bool:
    """Whether `d`, one of obj's referents, is obj's __dict__ (its first key names an
    attribute of obj holding its first value), told without asking for obj.__dict__."""
    if type(d) is not dict or not d:
        return False
    key = next(iter(d))
    return type(key) is str and getattr(obj, key, _MISSING) is d[key]


_MISSING = object()


def _path(node: _Node) -> str:
    if node.parent is None:
        return "dataset"
    key = node.key if node.key is not None else _attribute(node.parent.obj, node.obj)
    return _path(node.parent) + key


def _attribute(owner: Any, value: Any) -> str:
    """How `owner` holds `value`: ".name" (a slot or its __dict__), ".name['key']" (a
    dict it holds), else ".?"."""
    for cls in type(owner).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if getattr(owner, slot, None) is value:
                return f".{slot}"
    attributes = getattr(owner, "__dict__", {})
    for name, v in attributes.items():
        if v is value:
            return f".{name}"
    for name, v in attributes.items():
        if type(v) is dict and len(v) <= SMALL:
            for key, x in v.items():
                if x is value:
                    return f".{name}[{key!r}]"
    return ".?"


def _measure(value: Any) -> tuple[str, str, int, int] | None:
    """(container, item, objects, bytes) of a large container of Python objects; None
    for anything else."""
    t = type(value)
    if t is list or t is tuple or t is dict:
        n = len(value)
        if n < MIN_OBJECTS:
            return None
        if t is dict:
            pairs = list(itertools.islice(value.items(), SAMPLE))
            keys, values = [k for k, _ in pairs], [v for _, v in pairs]
            each = sum(_size(k) + _size(v) for k, v in pairs) / max(1, len(pairs))
            return "dict", f"{_kind(keys)}:{_kind(values)}", n, _total(value, n, each)
        items = [value[i * n // SAMPLE] for i in range(SAMPLE)]
        return t.__name__, _kind(items), n, _total(value, n, _mean_size(items))
    module = getattr(t, "__module__", "") or ""
    if module == "numpy" and t.__name__ == "ndarray" and value.dtype.hasobject:
        n = int(value.size)
        if n < MIN_OBJECTS:
            return None
        items = [value.flat[i * n // SAMPLE] for i in range(SAMPLE)]
        return "ndarray", _kind(items), n, int(value.nbytes) + int(n * _mean_size(items))
    if (module == "pandas" or module.startswith("pandas.")) and \
            t.__name__ in ("DataFrame", "Series"):
        return _pandas(value, t.__name__)
    return None


def _pandas(value: Any, kind: str) -> tuple[str, str, int, int] | None:
    """A DataFrame's columns of Python objects, or such a Series."""
    columns = ([value] if kind == "Series" and _objects(value.dtype) else
               [] if kind == "Series" else
               [value[c] for c, dtype in value.dtypes.items() if _objects(dtype)])
    rows = len(value)
    n = rows * len(columns)
    if n < MIN_OBJECTS or not rows:
        return None
    items = [col.iat[i * rows // SAMPLE] for col in columns[:4] for i in range(SAMPLE)]
    return kind, _kind(items), n, int(n * (8 + _mean_size(items)))


def _objects(dtype: Any) -> bool:
    """Whether a pandas column holds Python objects: object dtype, or strings stored as
    Python str (pandas' StringDtype with storage "python", its default without pyarrow)."""
    return str(dtype) == "object" or getattr(dtype, "storage", None) == "python"


def _size(x: Any) -> int:
    """An item's size, with its own items' where it is a small tuple, list or dict."""
    size = sys.getsizeof(x)
    if type(x) in (tuple, list) and len(x) <= SMALL:
        size += sum(sys.getsizeof(y) for y in x)
    elif type(x) is dict and len(x) <= SMALL:
        size += sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in x.items())
    return size


def _mean_size(items: list[Any]) -> float:
    return sum(map(_size, items)) / max(1, len(items))


def _total(container: Any, n: int, each: float) -> int:
    return int(sys.getsizeof(container) + n * each)


def _kind(items: list[Any]) -> str:
    names = {type(x).__name__ for x in items}
    return names.pop() if len(names) == 1 else "mixed"
