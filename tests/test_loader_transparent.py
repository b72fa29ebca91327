"""The instrumentation never changes what the training loop sees."""

from __future__ import annotations

import copy
import pickle
import typing
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from support.helpers import refreshes, scrape, value
from support.torch_helpers import (
    BurnDataset,
    FailingDataset,
    GetItemsDataset,
    RangeIterable,
    SizedRangeIterable,
    SleepDataset,
    WhoAmI,
    WhoAmIIterable,
)
from torch.utils.data import BatchSampler, RandomSampler
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data.datapipes.iter import IterableWrapper

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat

pytestmark = pytest.mark.torch

WORKERS = [0, 2]


def batches(loader: Any, epochs: int = 1) -> list[list[Any]]:
    out = []
    for _ in range(epochs):
        out.append([_plain(b) for b in loader])
    return out


def _plain(b: Any) -> Any:
    if isinstance(b, torch.Tensor):
        return b.tolist()
    if isinstance(b, (list, tuple)):
        return [_plain(x) for x in b]
    return b


def pair(dataset: Any, registry: CollectorRegistry, **kw: Any) -> tuple[Any, Any]:
    """The same loader twice, bare and instrumented, with equal seeded generators."""
    bare = TorchDataLoader(dataset, generator=torch.Generator().manual_seed(7), **kw)
    ours = instrument.DataLoader(dataset, generator=torch.Generator().manual_seed(7),
                                 name="t", registry=registry, **kw)
    return bare, ours


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_shuffled_batches_arrive_identical_and_in_the_same_order(
        registry: CollectorRegistry, workers: int, persistent: bool) -> None:
    kw = {"batch_size": 3, "shuffle": True, "num_workers": workers,
          "persistent_workers": persistent}
    bare, ours = pair(SleepDataset(10), registry, **kw)
    assert batches(ours, 2) == batches(bare, 2)
    assert len(ours) == len(bare) == 4


@pytest.mark.parametrize("workers", WORKERS)
def test_iterable_datasets_give_the_same_items(registry: CollectorRegistry,
                                               workers: int) -> None:
    bare, ours = pair(RangeIterable(9), registry, batch_size=2, num_workers=workers)
    assert batches(ours) == batches(bare)
    assert value(registry, cat.SAMPLES.name, loader="t", rank="0") == 9


def test_len_of_an_iterable_without_len_raises_the_same_type_error(
        registry: CollectorRegistry) -> None:
    bare, ours = pair(RangeIterable(4), registry, batch_size=2)
    with pytest.raises(TypeError) as theirs:
        len(bare)
    with pytest.raises(TypeError) as mine:
        len(ours)
    assert str(mine.value) == str(theirs.value)
    sized_bare, sized = pair(SizedRangeIterable(4), registry, batch_size=2)
    assert len(sized) == len(sized_bare) == 2


@pytest.mark.slow  # torch joins each worker a dataset error ended for 5 s
@pytest.mark.parametrize("workers", WORKERS)
def test_dataset_errors_reach_the_loop_with_the_same_type_and_message(
        registry: CollectorRegistry, workers: int) -> None:
    bare, ours = pair(FailingDataset(8, bad=5), registry, batch_size=2, num_workers=workers)
    got = []
    with pytest.raises(ValueError) as theirs:
        for _ in bare:
            pass
    with pytest.raises(ValueError) as mine:
        for b in ours:
            got.append(b)
    assert len(got) == 2
    assert str(mine.value).splitlines()[0] == str(theirs.value).splitlines()[0]
    assert "corrupt sample 5" in str(mine.value)


def test_an_exhausted_iterator_keeps_raising_stop_iteration(
        registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(SleepDataset(2), batch_size=2, name="t", registry=registry)
    it = iter(loader)
    next(it)
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(it)
    assert len(it) == 1
    assert value(registry, cat.BATCHES.name, loader="t", rank="0") == 1


@pytest.mark.parametrize("workers", WORKERS)
def test_break_mid_epoch_then_a_full_epoch_works(registry: CollectorRegistry,
                                                 workers: int) -> None:
    bare, ours = pair(SleepDataset(8), registry, batch_size=2, num_workers=workers)
    for i, _ in enumerate(ours):
        if i == 1:
            break
    refreshes(ours)
    assert batches(ours) == batches(bare)
    refreshes(ours)
    assert value(registry, cat.BATCHES.name, loader="t", rank="0") == 2 + 4
    assert value(registry, cat.WORKERS_LOST.name, loader="t", rank="0") == 0


def test_nested_iteration_over_one_loader_matches_torch(registry: CollectorRegistry) -> None:
    bare, ours = pair(SleepDataset(4), registry, batch_size=2)
    mine = [(_plain(a), _plain(b)) for a in ours for b in ours]
    theirs = [(_plain(a), _plain(b)) for a in bare for b in bare]
    assert mine == theirs


def _collate(batch: list[Any]) -> Any:
    return torch.utils.data.default_collate(batch)


def _init(worker_id: int) -> None:
    pass


def test_the_loader_is_still_a_torch_dataloader_with_the_users_objects(
        registry: CollectorRegistry) -> None:
    ds = SleepDataset(4)
    loader = instrument.DataLoader(ds, batch_size=2, num_workers=2, name="t", registry=registry,
                                   collate_fn=_collate, worker_init_fn=_init)
    sampler, batch_sampler = loader.sampler, loader.batch_sampler
    for _ in loader:
        assert loader.dataset is ds and loader.collate_fn is _collate
        assert loader.worker_init_fn is _init
    assert isinstance(loader, TorchDataLoader)
    assert loader.dataset is ds and loader.worker_init_fn is _init
    assert loader.collate_fn is _collate
    assert loader.sampler is sampler and loader.batch_sampler is batch_sampler


def _seed_worker(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    assert info is not None
    info.dataset.offset = 1000  # the worker's copy of the dataset


class OffsetDataset(SleepDataset):
    offset = 0

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = super().__getitem__(i)
        return x + self.offset, y


def test_worker_init_fn_sees_the_users_dataset_object(registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(OffsetDataset(4), batch_size=1, num_workers=2, name="t",
                                   registry=registry, worker_init_fn=_seed_worker)
    assert sorted(int(x[0][0]) for x, _ in loader) == [1000, 1001, 1002, 1003]


def test_copies_keep_the_registry_and_a_pickled_loader_takes_the_default_one(
        registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(SleepDataset(4), batch_size=2, name="c", registry=registry)
    for dup in (copy.copy(loader), copy.deepcopy(loader)):
        assert isinstance(dup, instrument.DataLoader) and dup.registry is registry
        assert batches(dup) == batches(loader)
    # Two copies, each side by side with the original: four epochs of two batches, all here.
    assert value(registry, cat.BATCHES.name, loader="c", rank="0") == 4 * 2
    sent = pickle.loads(pickle.dumps(loader))  # to another process: its own default
    assert sent.registry is None
    for _ in sent:
        pass
    assert value(instrument.default_registry(), cat.BATCHES.name, loader="c", rank="0") == 2


def test_a_pickled_loader_unpickles_and_iterates_the_same(registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(SleepDataset(6), batch_size=2, name="pickled",
                                   registry=registry)
    copy = pickle.loads(pickle.dumps(loader))
    assert isinstance(copy, instrument.DataLoader) and copy.name == "pickled"
    assert batches(copy) == batches(loader)


def worker_figures(registry: CollectorRegistry, metric: cat.Metric) -> list[float]:
    return [v for (k, _), v in scrape(registry).items() if k == metric.name]


@pytest.mark.parametrize(("workers", "persistent"),
                         [(0, False), (1, False), (1, True), (2, False), (2, True)])
def test_datapipes_are_sharded_and_reseeded_exactly_as_torch_does(
        registry: CollectorRegistry, workers: int, persistent: bool) -> None:
    def pipe() -> Any:
        return IterableWrapper(range(12)).shuffle().sharding_filter()

    kw = {"batch_size": None, "num_workers": workers, "persistent_workers": persistent}
    bare = TorchDataLoader(pipe(), generator=torch.Generator().manual_seed(7), **kw)
    ours = instrument.DataLoader(pipe(), generator=torch.Generator().manual_seed(7),
                                 name="t", registry=registry, **kw)
    mine, theirs = batches(ours, 2), batches(bare, 2)
    assert mine == theirs
    assert all(sorted(epoch) == list(range(12)) for epoch in mine)  # each item once
    assert mine[0] != mine[1]  # reseeded: the second epoch has its own order
    assert value(registry, cat.SAMPLES.name, loader="t", rank="0") == 24
    if workers:
        assert sum(worker_figures(registry, cat.WORKER_SAMPLES)) == 24


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_workers_see_the_users_own_dataset_object(registry: CollectorRegistry,
                                                  kind: str) -> None:
    dataset = WhoAmI(6) if kind == "map" else WhoAmIIterable(6)
    bare, ours = pair(dataset, registry, batch_size=None, num_workers=2)
    mine, theirs = batches(ours), batches(bare)
    assert mine == theirs
    assert {tuple(item[1:]) for item in mine[0]} == (
        {(type(dataset).__qualname__, True)} if kind == "map" else {(type(dataset).__qualname__,)})


def _same_everywhere(dataset: Any, registry: CollectorRegistry, samples: int | None,
                     **kw: Any) -> None:
    """Two epochs of the same loader, bare and instrumented, give identical batches, and
    the workers' figures add up (samples None: they cannot be known, and are not given)."""
    bare, ours = pair(dataset, registry, **kw)
    assert batches(ours, 2) == batches(bare, 2)
    if samples is None:
        assert worker_figures(registry, cat.WORKER_SAMPLES) == []
        assert value(registry, cat.SAMPLES.name, loader="t", rank="0") is None
    else:
        assert sum(worker_figures(registry, cat.WORKER_SAMPLES)) == 2 * samples
    assert len(worker_figures(registry, cat.WORKER_CPU)) == kw["num_workers"]
    assert all(v > 0 for v in worker_figures(registry, cat.WORKER_CPU))


def test_a_batch_sampler_gives_the_same_batches(registry: CollectorRegistry) -> None:
    def batch_sampler() -> BatchSampler:
        return BatchSampler(RandomSampler(range(10), generator=torch.Generator().manual_seed(3)),
                            batch_size=3, drop_last=False)

    bare = TorchDataLoader(SleepDataset(10), batch_sampler=batch_sampler(), num_workers=2)
    sampler = batch_sampler()
    ours = instrument.DataLoader(SleepDataset(10), batch_sampler=sampler, num_workers=2,
                                 name="t", registry=registry)
    assert batches(ours, 2) == batches(bare, 2)
    assert ours.batch_sampler is sampler
    assert sum(worker_figures(registry, cat.WORKER_SAMPLES)) == 20


def test_a_getitems_dataset_is_fetched_through_getitems_as_torch_does(
        registry: CollectorRegistry) -> None:
    _same_everywhere(GetItemsDataset(9), registry, 9, batch_size=4, shuffle=True,
                     num_workers=2)


def test_an_iterable_dataset_without_batching_gives_the_same_items(
        registry: CollectorRegistry) -> None:
    """Each item a lone tensor of shape [1]: one sample, or a batch of one? Not known, so
    no sample count is given (item_len in instrument/hotpath/batch.py)."""
    _same_everywhere(RangeIterable(7), registry, None, batch_size=None, num_workers=2)


@pytest.mark.slow  # torch joins each worker a dataset error ended for 5 s
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_every_start_method_gives_the_same_batches_and_worker_figures(
        registry: CollectorRegistry, method: str) -> None:
    _same_everywhere(BurnDataset(6, 0.001), registry, 6, batch_size=2, shuffle=True,
                     num_workers=2, persistent_workers=True, multiprocessing_context=method)


def test_the_loader_is_generic_like_torchs() -> None:
    alias = instrument.DataLoader[list[torch.Tensor]]
    assert typing.get_origin(alias) is instrument.DataLoader

    def make() -> instrument.DataLoader[int]:  # evaluated below, as at import time
        raise NotImplementedError

    hints = typing.get_type_hints(make)
    assert typing.get_args(hints["return"]) == (int,)
    assert issubclass(instrument.DataLoader, TorchDataLoader)


def test_wrap_returns_a_torch_loader_itself_so_settings_and_isinstance_are_its_own(
        registry: CollectorRegistry) -> None:
    inner = TorchDataLoader(SleepDataset(4), batch_size=2)
    wrapped = instrument.wrap(inner, name="t", registry=registry)
    assert wrapped is inner and isinstance(wrapped, TorchDataLoader)
    with pytest.raises(ValueError):
        wrapped.batch_size = 3
    wrapped.timeout = 7
    assert inner.timeout == 7
    assert instrument.wrap(wrapped, name="other", registry=registry) is inner


def test_wrapped_loader_delegates_len_attributes_and_batches(
        registry: CollectorRegistry) -> None:
    inner = TorchDataLoader(SleepDataset(5), batch_size=2)
    loader = instrument.wrap(inner, name="t", registry=registry)
    assert len(loader) == len(inner) == 3
    assert loader.batch_size == 2 and loader.dataset is inner.dataset
    assert batches(loader) == batches(inner)
    generator = instrument.wrap(iter([torch.ones(2), torch.zeros(3)]), name="g",
                                registry=registry)
    with pytest.raises(TypeError):
        len(generator)
    assert [b.shape[0] for b in generator] == [2, 3]
    assert value(registry, cat.SAMPLES.name, loader="g", rank="0") == 5


class Unreadable(Mapping):  # type: ignore[type-arg]
    """A batch whose contents cannot be walked: the loop must still get it."""

    def __getitem__(self, key: str) -> int:
        raise RuntimeError("unreadable")

    def __iter__(self) -> Any:
        raise RuntimeError("unreadable")

    def __len__(self) -> int:
        return 1


def test_batches_the_metrics_cannot_measure_still_reach_the_loop(
        registry: CollectorRegistry) -> None:
    items = [Unreadable() for _ in range(70)]  # past the every-64th-batch byte sample too
    loader = instrument.wrap(items, name="t", registry=registry)
    assert all(a is b for a, b in zip(loader, items, strict=True))
    assert value(registry, cat.BATCHES.name, loader="t", rank="0") == 70


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_a_wrapped_torch_loader_gives_what_a_bare_one_gives_side_by_side(
        registry: CollectorRegistry, workers: int, persistent: bool) -> None:
    """wrap() of a torch DataLoader is timed through the hook on torch's public __iter__:
    the same batches, order and types as an untouched twin, and its own collate_fn."""
    kw = {"batch_size": 3, "shuffle": True, "num_workers": workers,
          "persistent_workers": persistent}
    bare = TorchDataLoader(SleepDataset(10), generator=torch.Generator().manual_seed(7), **kw)
    inner = TorchDataLoader(SleepDataset(10), generator=torch.Generator().manual_seed(7), **kw)
    collate = inner.collate_fn
    wrapped = instrument.wrap(inner, name="w", registry=registry)
    got, want = batches(wrapped, 2), batches(bare, 2)
    assert got == want
    assert value(registry, cat.BATCHES.name, loader="w", rank="0") == 8
    assert [type(b) for b in next(iter(wrapped))] == [type(b) for b in next(iter(bare))]
    assert wrapped.collate_fn is collate


@pytest.mark.slow  # torch joins each worker a dataset error ended for 5 s
@pytest.mark.parametrize("workers", WORKERS)
def test_a_wrapped_torch_loader_raises_what_a_bare_one_raises(
        registry: CollectorRegistry, workers: int) -> None:
    def failure(loader: Any) -> str:
        with pytest.raises(Exception) as info:
            for _ in loader:
                pass
        return f"{type(info.value).__name__}: {info.value}".split("\n")[0]

    bare = TorchDataLoader(FailingDataset(6, 3), batch_size=2, num_workers=workers)
    wrapped = instrument.wrap(TorchDataLoader(FailingDataset(6, 3), batch_size=2,
                                              num_workers=workers), name="f", registry=registry)
    assert failure(wrapped) == failure(bare)


@pytest.mark.parametrize("workers", WORKERS)
def test_copying_or_pickling_the_iterator_fails_as_torchs_and_the_epoch_goes_on(
        registry: CollectorRegistry, workers: int) -> None:
    bare, ours = pair(SleepDataset(6), registry, batch_size=2, num_workers=workers)
    its = [iter(bare), iter(ours)]
    got: list[list[Any]] = [[], []]
    for k, it in enumerate(its):
        got[k].append(_plain(next(it)))
        for attempt in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(Exception) as failed:
                attempt(it)
            got[k].append((attempt.__name__, type(failed.value), failed.value.args))
        got[k].extend(_plain(b) for b in it)
    assert got[1] == got[0]
    assert got[0][1][1] is NotImplementedError  # torch's own word, not ours
