"""The dataset's large containers of Python objects, which forked workers copy as they
read them (copy-on-read), found once before a loader's first pool of forked workers starts.

A forked worker shares its parent's memory copy-on-write; reading an object writes its
reference count, so a worker that reads the items of a list of 3,000,000 paths copies the
pages they sit on, and each worker ends up with its own copy (memgrowth.py sees it grow).
A numpy array, a pyarrow array or a tensor holds its items in one buffer with one reference
count: nothing is copied. (Under spawn or forkserver each worker unpickles its own copy of
the dataset from the start: nothing grows, and nothing is looked at.)

What is looked at: the dataset itself (DataLoader(paths)), its attributes, the attributes of
the torch Datasets it holds (Subset, ConcatDataset, any other, up to MAX_DEPTH), and the
items of a small list, tuple or dict among them (a dict of lists). A list, tuple or dict (or
a subclass: defaultdict, OrderedDict), object-dtype numpy array or pandas column of
MIN_OBJECTS Python objects or more is a container, reported with its path (dataset.paths,
dataset.dataset.samples, dataset.datasets[0].paths, dataset.index['paths']), its type, its
items' type, their count and an estimate of their size from a sample of SAMPLE items.

What looking costs the training: nothing it can see. No user code runs: an instance's
attributes are reached with gc.get_referents and read with object.__getattribute__ (no
property, __getattr__ or proxy is called: a name a class defines is skipped), lengths and
items of containers through the base types' own methods. The dataset's __dict__ is never
made (in CPython 3.11, asking for an instance's __dict__ slows every later attribute read
of it about threefold): a container is named from the names its class's code uses. No
item is touched but a container's sample (their reference counts written once in the
parent, before the fork). numpy and pandas objects are recognised by their type's module,
never imported. The scan stops after SCAN_BUDGET seconds, with what it found so far; an
object that cannot be looked at is passed over.
"""

from __future__ import annotations

import gc
import itertools
import re
import sys
from dataclasses import dataclass
from time import perf_counter
from types import MemberDescriptorType
from typing import Any, NamedTuple

import torch

MIN_OBJECTS = 100_000  # items of a container worth naming (about 10 MB of str)
SAMPLE = 16  # items whose size is read, evenly spread
SMALL = 16  # a list, tuple or dict this small is looked into, one level
MAX_DEPTH = 3  # datasets within datasets looked into
SCAN_BUDGET = 0.01  # seconds
MOST = 3  # containers reported per loader, the largest by size
REFERENTS = 256  # an object's attributes looked at, at most
COLUMNS = 256  # a DataFrame's columns looked at, at most
KEY = re.compile(r"[A-Za-z_][\w.-]{0,63}")  # a dict key shown in a path; others read […]


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
    root = _Node(dataset, None, None, 0)
    try:
        measured = _measure(dataset)
    except Exception:
        measured = None
    if measured is not None:
        return (Container("dataset", *measured),)
    todo = [root]
    seen = {id(dataset)}
    while todo and perf_counter() < deadline:
        node = todo.pop(0)
        try:
            held = members(node.obj)
        except Exception:
            continue
        for value, key in held:
            if perf_counter() >= deadline:
                break
            if id(value) in seen:
                continue
            seen.add(id(value))
            child = _Node(value, node, key, node.depth + 1)
            try:
                measured = _measure(value)
                if measured is not None:
                    found.append(Container(_path(child)[:200], *measured))
                elif issubclass(type(value), torch.utils.data.Dataset):
                    if child.depth <= MAX_DEPTH:
                        todo.append(child)
                elif key is None and type(value) in (list, tuple, dict) and len(value) <= SMALL:
                    todo.append(child)  # a dict of lists, a list of datasets: their items
            except Exception:
                continue
    found.sort(key=lambda c: -c.bytes)
    return tuple(found[:MOST])


def members(obj: Any) -> list[tuple[Any, str | None]]:
    """An object's attribute values (key None), or a small list's, tuple's or dict's
    items (with their key), without making an instance's __dict__."""
    t = type(obj)
    if t is list or t is tuple:
        return [(v, f"[{i}]") for i, v in enumerate(obj)] if len(obj) <= SMALL else []
    if t is dict:
        return [(v, _key(k)) for k, v in obj.items()] if len(obj) <= SMALL else []
    out: list[tuple[Any, str | None]] = []
    for v in itertools.islice(gc.get_referents(obj), REFERENTS):
        if v is t:
            continue
        if _instance_dict(obj, v):  # made already: its values are the attributes
            out += [(x, None) for x in itertools.islice(v.values(), REFERENTS)]
        else:
            out.append((v, None))
    return out


def _key(k: Any) -> str:
    """A dict key as a path shows it: short names and numbers as written, others […]."""
    if (type(k) is str and KEY.fullmatch(k)) or type(k) is int:
        return f"[{k!r}]"
    return "[…]"


def _defined(cls: type, name: str) -> bool:
    """Whether a class of cls's MRO defines `name` (a method, property or class value:
    reading it could run code, and it is no instance attribute anyway), but as a slot."""
    return any(name in vars(c) and type(vars(c)[name]) is not MemberDescriptorType
               for c in cls.__mro__)


def _own(obj: Any, name: str) -> Any:
    """obj's instance attribute `name`, read without running any of its code; _MISSING."""
    if _defined(type(obj), name):
        return _MISSING
    try:
        return object.__getattribute__(obj, name)
    except Exception:
        return _MISSING


def _instance_dict(obj: Any, d: Any) -> bool:
    """Whether `d`, one of obj's referents, is obj's __dict__ (its first key names an
    instance attribute of obj holding its first value), told without asking for
    obj.__dict__."""
    if type(d) is not dict or not d:
        return False
    key = next(iter(d))
    return type(key) is str and _own(obj, key) is d[key]


_MISSING = object()


def _path(node: _Node) -> str:
    if node.parent is None:
        return "dataset"
    key = node.key if node.key is not None else attribute_of(node.parent.obj, node.obj)
    return _path(node.parent) + key


def attribute_of(owner: Any, value: Any) -> str:
    """How `owner` holds `value`: ".name" (an instance attribute or slot),
    ".name['key']" (a small dict it holds), else ".?". The names tried are its __dict__'s
    where that is made already, else its slots and the names its class's code uses."""
    made = [d for d in gc.get_referents(owner) if _instance_dict(owner, d)]
    names = list(made[0]) if made else _names(type(owner))
    held = [(n, _own(owner, n)) for n in names]
    for name, v in held:
        if v is value:
            return f".{name}"
    for name, v in held:
        if type(v) is dict and len(v) <= SMALL:
            for key, x in v.items():
                if x is value:
                    return f".{name}{_key(key)}"
    return ".?"


def _names(cls: type) -> list[str]:
    """The slots of cls's MRO and the names its functions use (self.paths = ... in
    __init__ names "paths"), which its instance attributes are among."""
    out: dict[str, None] = {}
    for c in cls.__mro__:
        slots = vars(c).get("__slots__", ())
        out.update(dict.fromkeys((slots,) if isinstance(slots, str) else slots))
        for v in vars(c).values():
            code = getattr(v, "__code__", None)
            todo = [code] if code is not None else []
            while todo:
                co = todo.pop()
                out.update(dict.fromkeys(co.co_names))
                todo += [k for k in co.co_consts if hasattr(k, "co_names")]
    return [n for n in out if type(n) is str]


def _measure(value: Any) -> tuple[str, str, int, int] | None:
    """(container, item, objects, bytes) of a large container of Python objects; None
    for anything else. Subclasses of list, tuple and dict are read through the base
    types' own methods, never their overrides."""
    t = type(value)
    base = list if isinstance(value, list) else tuple if isinstance(value, tuple) else \
        dict if isinstance(value, dict) else None
    if base is not None:
        n = base.__len__(value)
        if n < MIN_OBJECTS:
            return None
        if base is dict:
            pairs = list(itertools.islice(dict.items(value), SAMPLE))
            keys, values = [k for k, _ in pairs], [v for _, v in pairs]
            each = sum(_size(k) + _size(v) for k, v in pairs) / max(1, len(pairs))
            return t.__name__, f"{_kind(keys)}:{_kind(values)}", n, _total(value, n, each)
        items = [base.__getitem__(value, i * n // SAMPLE) for i in range(SAMPLE)]
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
    """A DataFrame's columns of Python objects (among its first COLUMNS), or such a
    Series; read by position (a frame may repeat a column's name)."""
    rows = len(value)
    if kind == "Series":
        picked = [0] if _objects(value.dtype) else []
    else:
        dtypes = value.dtypes
        picked = [j for j in range(min(COLUMNS, len(dtypes))) if _objects(dtypes.iat[j])]
    n = rows * len(picked)
    if n < MIN_OBJECTS or not rows:
        return None
    rows_at = [i * rows // SAMPLE for i in range(SAMPLE)]
    items = ([value.iat[r] for r in rows_at] if kind == "Series" else
             [value.iat[r, j] for j in picked[:4] for r in rows_at])
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
