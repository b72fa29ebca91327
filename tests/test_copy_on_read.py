"""Copy-on-read: the dataset's large containers of Python objects, named before the first
pool (instrument/cowscan.py), and how fast the workers' private memory grows
(instrument/memgrowth.py), read from readings a test makes and from real forked workers."""

from __future__ import annotations

import collections
import gc
import sys
import time
import weakref
from collections import deque

import numpy as np
import pandas as pd
import pytest
import torch
from torch.utils.data import ConcatDataset, Dataset, Subset

from dataloader_exporter.instrument import cowscan
from dataloader_exporter.instrument.cowscan import MIN_OBJECTS, Container, scan
from dataloader_exporter.instrument.memgrowth import (
    GROWTH_SPAN,
    PrivateGrowth,
    growth_rate,
)

pytestmark = pytest.mark.torch

N = MIN_OBJECTS + 1000
MiB = 1 << 20


class Paths(Dataset):  # type: ignore[type-arg]
    """Its attributes set as datasets set them, by name in __init__ (`more`: by setattr)."""

    def __init__(self, paths: object, index: object = None, **more: object) -> None:
        self.paths = paths
        self.label = 3
        self.tiny = [1, 2, 3]
        self.index = index
        for k, v in more.items():
            setattr(self, k, v)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


class Slotted(Dataset):  # type: ignore[type-arg]
    __slots__ = ("rows",)

    def __init__(self, rows: object) -> None:
        self.rows = rows


def paths(n: int = N) -> list[str]:
    return [f"/data/train/{i:09d}.jpg" for i in range(n)]


def only(found: tuple[Container, ...]) -> Container:
    assert len(found) == 1, found
    return found[0]


def test_a_list_of_paths_is_named_with_its_count_type_and_size() -> None:
    c = only(scan(Paths(paths())))
    assert (c.attribute, c.container, c.item, c.objects) == ("dataset.paths", "list", "str", N)
    # The list's pointers and its str (about 75 bytes each here): within 20% of the truth.
    truth = sys.getsizeof(held := paths()) + sum(map(sys.getsizeof, held))
    assert 0.8 * truth < c.bytes < 1.2 * truth


@pytest.mark.parametrize("held, want", [
    (tuple(range(10**6, 10**6 + N)), ("tuple", "int")),
    ({i: str(i) for i in range(N)}, ("dict", "int:str")),
    ([(p, i) for i, p in enumerate(paths())], ("list", "tuple")),
    (np.array(paths(), dtype=object), ("ndarray", "str")),
    (pd.DataFrame({"path": paths(), "label": range(N)}), ("DataFrame", "str")),
    (pd.Series(paths(), dtype=object), ("Series", "str")),
], ids=["tuple", "dict", "list-of-tuples", "object-array", "dataframe", "object-series"])
def test_every_kind_of_container_of_python_objects_is_found(held: object,
                                                             want: tuple[str, str]) -> None:
    c = only(scan(Paths(held)))
    assert (c.attribute, c.container, c.item) == ("dataset.paths", *want)
    assert c.objects == N


@pytest.mark.parametrize("held", [
    np.array(paths(), dtype="S"), torch.arange(N), np.arange(N), "x" * N, b"x" * N,
    list(range(MIN_OBJECTS - 1)), pd.DataFrame({"label": range(N)}),
], ids=["bytes-array", "tensor", "int-array", "str", "bytes", "small-list", "int-frame"])
def test_buffers_and_small_containers_are_not_containers_of_objects(held: object) -> None:
    assert scan(Paths(held)) == ()


def test_wrapped_datasets_are_looked_into_and_named_by_their_path() -> None:
    inner = Paths(paths(), index={"paths": paths(), "root": "/data"})
    assert {c.attribute for c in scan(Subset(inner, range(10)))} == {
        "dataset.dataset.paths", "dataset.dataset.index['paths']"}
    both = scan(ConcatDataset([Paths([1]), inner]))
    assert {c.attribute for c in both} == {"dataset.datasets[1].paths",
                                           "dataset.datasets[1].index['paths']"}
    split = scan(Subset(Paths(np.zeros(3)), list(range(10**6, 10**6 + N))))
    assert only(split).attribute == "dataset.indices"  # random_split's list of ints
    assert only(scan(Slotted(paths()))).attribute == "dataset.rows"


def test_only_the_largest_few_are_kept_largest_first() -> None:
    small, big = paths(), [p * 3 for p in paths()]
    found = scan(Paths(small, index=big, c=tuple(small), d=dict.fromkeys(small)))
    assert len(found) == cowscan.MOST
    assert found[0].attribute == "dataset.index"
    assert [c.bytes for c in found] == sorted((c.bytes for c in found), reverse=True)


def made(obj: object) -> bool:
    """Whether obj's __dict__ is made: gc.get_referents sees the attribute values
    themselves until it is, then the dict."""
    return any(type(r) is dict and "paths" in r for r in gc.get_referents(obj))


def test_looking_leaves_the_datasets_attributes_as_they_were() -> None:
    """In CPython 3.11 an instance's __dict__, once made, slows every later attribute read
    of it: a dataset is looked at and its containers named without it (its control makes
    it); an attribute set by a name its class's code does not use reads `.?`."""
    plain, named, dynamic, control = (Paths(np.zeros(3)), Paths(paths()),
                                      Paths([0], extra=paths()), Paths(np.zeros(3)))
    assert scan(plain) == ()
    assert only(scan(named)).attribute == "dataset.paths"
    assert only(scan(dynamic)).attribute == "dataset.?"
    vars(control)
    assert not any(map(made, (plain, named, dynamic)))
    assert made(control)


class Lazy(Dataset):  # type: ignore[type-arg]
    """A dataset whose property loads data, and whose __getattr__ would recurse."""

    def __init__(self) -> None:
        self.config = {"data": 1}  # a dict whose first key a property of the class names
        self.paths = paths()
        self.ref = weakref.proxy(Paths([0]))  # dead at once: reading it raises

    @property
    def data(self) -> object:
        raise AssertionError("the scan ran the dataset's code")

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_no_code_of_the_dataset_runs_and_what_cannot_be_read_is_passed_over() -> None:
    assert only(scan(Lazy())).attribute == "dataset.paths"


def test_the_dataset_itself_may_be_the_container() -> None:
    c = only(scan(paths()))
    assert (c.attribute, c.container, c.item) == ("dataset", "list", "str")
    assert scan(list(range(MIN_OBJECTS - 1))) == ()  # not enumerated either: no time spent


def test_subclasses_are_read_through_the_base_types_methods() -> None:
    class Odd(list):  # type: ignore[type-arg]
        def __len__(self) -> int:
            raise AssertionError("its own __len__ ran")

    held = collections.defaultdict(int, {p: 1 for p in paths()})
    assert only(scan(Paths(Odd(paths())))).container == "Odd"
    c = only(scan(Paths(held)))
    assert (c.container, c.item) == ("defaultdict", "str:int")


def test_long_or_odd_dict_keys_do_not_reach_the_path() -> None:
    found = scan(Paths([0], index={"/data/train/x.jpg": paths()}))
    assert only(found).attribute == "dataset.index[…]"


def test_the_scan_is_bounded_in_time_and_cheap_without_containers() -> None:
    class Many(Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.parts = [Paths(paths(MIN_OBJECTS)) for _ in range(3)]

    start = time.perf_counter()
    scan(Many(), budget=0.0)  # past its budget at once: what it found first, no more
    assert time.perf_counter() - start < 0.5  # what the object count alone would cost
    plain = Paths(np.zeros(3))
    times = []
    for _ in range(20):
        t = time.perf_counter()
        scan(plain)
        times.append(time.perf_counter() - t)
    assert sorted(times)[10] < 0.01  # the median: microseconds; bench/cowscan.py measures


# --- growth ------------------------------------------------------------------------------

def readings(values: list[float], every: float = 3.0) -> deque[tuple[float, int]]:
    return deque((i * every, int(v * MiB)) for i, v in enumerate(values))


def test_growth_is_a_robust_slope_and_a_few_mib_either_way_are_flat() -> None:
    steady = readings([100 + 3 * i for i in range(12)])
    assert growth_rate(steady) == pytest.approx(1 * MiB, rel=0.01)  # 3 MiB per 3 s
    stepped = readings([100 + 3 * i + (40 if i == 5 else 0) for i in range(12)])
    assert growth_rate(stepped) == pytest.approx(1 * MiB, rel=0.05)  # one odd reading
    batches = readings([100 + (3 if i % 2 else 0) for i in range(12)])  # a batch in hand
    assert growth_rate(batches) == 0.0
    creep = readings([100 + 0.1 * i for i in range(12)])  # 1.1 MiB in 33 s: within NOISE
    assert growth_rate(creep) == 0.0
    assert growth_rate(readings([100] * 5)) is None  # too few
    assert growth_rate(readings([100] * 8, every=(GROWTH_SPAN - 1) / 7)) is None  # too short


def test_a_pool_sums_its_workers_and_keeps_the_latest_after_they_end() -> None:
    g = PrivateGrowth()
    for i in range(10):
        g.add({1: (50 + 2 * i) * MiB, 2: (60 + 3 * i) * MiB}, 1000.0 + 3 * i)
    assert g.rate == pytest.approx((2 + 3) / 3 * MiB, rel=0.01)
    g.end(1)
    g.end(2)
    assert g.rate == pytest.approx((2 + 3) / 3 * MiB, rel=0.01)  # kept: the latest measured
    assert g.ended == {1: (52 * MiB, 68 * MiB), 2: (63 * MiB, 87 * MiB)}  # past their start


def test_a_workers_first_reading_its_start_is_not_growth() -> None:
    g = PrivateGrowth()
    for i in range(10):
        g.add({7: (5 if i == 0 else 40) * MiB}, 3.0 * i)  # libraries loaded at its start
    assert g.rate == pytest.approx(0.0, abs=1.0)
