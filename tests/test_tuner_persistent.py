"""Persistent worker pools under the loader tuner (instrument/tuner/keep.py): a pool the
tuner keeps across epochs gives the loop exactly what torch's loader gives with a new pool
each epoch (the same items, drawn with the same RNGs, in the same order), side by side
over the same dataset and seeds; what it cannot keep it says why."""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from support.helpers import scrape
from support.torch_helpers import SleepDataset
from torch.utils.data import Dataset

from dataloader_exporter import instrument
from dataloader_exporter.core.tuner.persist import keep_pool
from dataloader_exporter.core.tuner.types import Budget, Epoch, Setting
from dataloader_exporter.instrument import compat

pytestmark = [pytest.mark.torch, pytest.mark.slow]

EPOCHS = 5
BATCH = 4
N = 48  # 12 batches an epoch: past tuner_epoch.MIN_BATCHES
Items = list[list[tuple[Any, ...]]]


class Random(Dataset[tuple[Any, ...]]):
    """Items drawn from every RNG a worker has (random, torch, numpy) and its WorkerInfo's
    seed, plus `epoch` (which the training may set between epochs)."""

    def __init__(self, n: int = N) -> None:
        self.n = n
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        info = torch.utils.data.get_worker_info()
        return (i, self.epoch, random.random(), float(torch.rand(())), float(np.random.rand()),
                info.seed if info is not None else -1)


def as_items(batch: Any) -> list[tuple[Any, ...]]:
    columns = [c.tolist() if isinstance(c, torch.Tensor) else list(c) for c in batch]
    return list(zip(*columns, strict=True))


def run(loader: Any, epochs: int = EPOCHS, set_epoch: bool = False
        ) -> tuple[Items, list[list[int]]]:
    """Every item of `epochs` epochs, and the worker pids of each epoch's pool."""
    torch.manual_seed(17)
    seen: Items = []
    pools: list[list[int]] = []
    for e in range(epochs):
        if set_epoch:
            loader.dataset.set_epoch(e)
        it = iter(loader)
        pools.append(compat.worker_pids(getattr(it, "_it", it)))
        seen.append([x for batch in it for x in as_items(batch)])
    return seen, pools


def pair(generator: bool, **kw: Any) -> tuple[Any, Any]:
    def gen() -> torch.Generator | None:
        return torch.Generator().manual_seed(5) if generator else None
    bare = torch.utils.data.DataLoader(Random(), batch_size=BATCH, shuffle=True,
                                       num_workers=2, generator=gen(), **kw)
    return bare, gen


@pytest.fixture
def keep_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.DEBUG, logger="dataloader_exporter.instrument"):
        yield caplog


@pytest.mark.parametrize("generator", [True, False], ids=["seeded", "global-rng"])
def test_auto_keeps_the_pool_and_the_loop_sees_what_new_pools_give(
        registry: CollectorRegistry, keep_log: pytest.LogCaptureFixture,
        generator: bool) -> None:
    bare, gen = pair(generator)
    expected, bare_pools = run(bare)
    tuned = instrument.DataLoader(Random(), batch_size=BATCH, shuffle=True, num_workers=2,
                                  generator=gen(), name="keep", registry=registry,
                                  tune=("persistent_workers",))
    got, pools = run(tuned)
    assert got == expected
    assert len({tuple(p) for p in bare_pools}) == EPOCHS  # torch: a new pool each epoch
    # The first epoch's pool started anew; kept from the second on.
    assert pools[0] != pools[1] and all(p == pools[1] for p in pools[2:]), pools
    assert tuned.persistent_workers is True
    assert "dataloader 'keep': persistent_workers False -> True: its 2 workers' start " \
        "held the first batch" in keep_log.text
    assert "keep.persistent_workers=true" in keep_log.text  # the stable line
    assert "set persistent_workers=True" not in keep_log.text  # the tuner's to decide
    changes = {dict(k[1])["reason"]: v for k, v in scrape(registry).items()
               if k[0] == "dataloader_tuner_changes_total"
               and dict(k[1])["setting"] == "persistent_workers"}
    assert changes == {"epoch-start": 1.0, "dataset-changed": 0.0}


def test_a_dataset_changed_between_epochs_gets_a_new_pool_and_the_reason(
        registry: CollectorRegistry, keep_log: pytest.LogCaptureFixture) -> None:
    bare, gen = pair(True)
    expected, _ = run(bare, set_epoch=True)
    tuned = instrument.DataLoader(Random(), batch_size=BATCH, shuffle=True, num_workers=2,
                                  generator=gen(), name="changing", registry=registry,
                                  tune=("persistent_workers",))
    got, pools = run(tuned, set_epoch=True)
    assert got == expected
    assert [x[1] for x in got[-1]] == [EPOCHS - 1] * N  # each epoch saw its own set_epoch
    assert len({tuple(p) for p in pools}) == EPOCHS  # a new pool each epoch, in the end
    assert "dataloader 'changing': persistent_workers True -> False: the training changes " \
        "dataset.epoch between epochs" in keep_log.text
    assert tuned.persistent_workers is False


def test_a_worker_init_fn_that_only_seeds_runs_again_in_a_kept_pool(
        registry: CollectorRegistry) -> None:
    transformers = pytest.importorskip("transformers.trainer_utils")
    init = functools.partial(transformers.seed_worker, num_workers=2, rank=0)
    bare, gen = pair(True, worker_init_fn=init)
    expected, _ = run(bare)
    tuned = instrument.DataLoader(Random(), batch_size=BATCH, shuffle=True, num_workers=2,
                                  generator=gen(), worker_init_fn=init, name="hf",
                                  registry=registry, tune=("persistent_workers",))
    got, pools = run(tuned)
    assert got == expected and pools[-1] == pools[1]


def _own_init(worker_id: int) -> None:
    np.random.seed(worker_id)


def test_what_auto_cannot_keep_it_leaves_and_says_why(
        registry: CollectorRegistry, keep_log: pytest.LogCaptureFixture) -> None:
    bare, gen = pair(True, worker_init_fn=_own_init)
    expected, _ = run(bare, epochs=3)
    tuned = instrument.DataLoader(Random(), batch_size=BATCH, shuffle=True, num_workers=2,
                                  generator=gen(), worker_init_fn=_own_init, name="init",
                                  registry=registry, tune=("persistent_workers",))
    got, pools = run(tuned, epochs=3)
    assert got == expected and len({tuple(p) for p in pools}) == 3
    assert "dataloader 'init': persistent_workers=auto keeps no pool: its worker_init_fn " \
        "(_own_init) runs at each worker's start" in keep_log.text


@pytest.mark.parametrize("where", ["env", "code"])
def test_persistent_true_beside_auto_workers_makes_the_tuners_pools_persistent(
        registry: CollectorRegistry, keep_log: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A loader built without workers, whose samples wait on storage: the tuner adds
    workers, persistent from its first pool; the order is an untuned loader's. Asked in
    the settings line, or in code (persistent_workers=True with num_workers=0, which
    torch alone refuses)."""
    data = SleepDataset(96, delay=0.004)
    bare = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True,
                                       generator=torch.Generator().manual_seed(3))
    if where == "env":
        monkeypatch.setenv("DATALOADER_EXPORTER_SETTINGS",
                           "store.num_workers=auto,store.persistent_workers=true")
        asked: dict[str, Any] = {}
    else:
        asked = {"num_workers": 0, "persistent_workers": True, "tune": True}
    tuned = instrument.DataLoader(data, batch_size=8, shuffle=True, name="store",
                                  generator=torch.Generator().manual_seed(3),
                                  registry=registry, **asked)

    def order(loader: Any, epochs: int) -> tuple[list[list[int]], list[tuple[int, ...]]]:
        seen, pools = [], []
        for _ in range(epochs):
            seen.append([int(i) for _, idx in loader for i in idx])
            pools.append(tuple(compat.worker_pids(compat.persistent_iterator(loader))))
        return seen, pools

    expected, _ = order(bare, 6)
    got, pools = order(tuned, 6)
    assert got == expected
    assert tuned.num_workers >= 2 and tuned.persistent_workers is True
    assert pools[-1] and pools[-1] == pools[-2], pools  # kept across the last epochs
    assert "not applied" not in keep_log.text
    if where == "env":
        assert "the tuner's worker pools will be persistent" in keep_log.text
    assert "set persistent_workers=True" not in keep_log.text  # no advice to do what it does


def _epoch(start_s: float | None, wall: float, workers: int = 4,
           worker_bytes: int | None = 100 << 20) -> Epoch:
    return Epoch(Setting(workers, 2), 100.0, 0.1, worker_bytes=worker_bytes, start_s=start_s,
                 start_share=None if start_s is None else start_s / wall)


def test_a_pool_is_kept_when_its_start_stalls_the_epoch_and_memory_holds_it_twice() -> None:
    room = Budget(cores=2, memory_room=2 * 4 * (100 << 20))
    assert keep_pool(_epoch(0.5, 5.0), room)[0]
    keep, why = keep_pool(_epoch(0.1, 5.0), room)  # 2%: under the 5% band
    assert not keep and "under 5%" in why
    keep, why = keep_pool(_epoch(0.5, 5.0), Budget(cores=2, memory_room=(800 << 20) - 1))
    assert not keep and "would leave less than that again" in why
    assert not keep_pool(_epoch(0.5, 5.0, worker_bytes=None), room)[0]
    assert not keep_pool(_epoch(0.5, 5.0), Budget(cores=2))[0]  # room unknown
    assert not keep_pool(_epoch(None, 5.0), room)[0]  # no pool started at iter()


@pytest.mark.parametrize("share", [0.2, 0.02], ids=["kept", "not-kept"])
def test_the_epoch_whose_pool_auto_keeps_is_judged_without_its_start(
        registry: CollectorRegistry, share: float) -> None:
    """The model's first workers, tried from none: their first epoch paid the new pool's
    start. Where auto keeps that pool from then on, the trial's window is that epoch as the
    kept pool runs it (3600 samples/s over 80% of its wall: 4500), which the epochs to come
    are judged with; a pool not kept (a 2% start) pays its start every epoch, as judged."""
    from dataloader_exporter.core.tuner.model import Load
    from dataloader_exporter.instrument.tuner.epoch import take_mark

    loader = instrument.DataLoader(Random(), batch_size=BATCH, name="judged",
                                   registry=registry,
                                   tune=("num_workers", "persistent_workers"))
    assert len(list(loader)) == N // BATCH  # the tuner starts at the first iter()
    tuning = loader._instruments.tuning
    assert tuning is not None and tuning.keeping.deciding
    room = Budget(1, 32 << 30, 16 << 30, 2.0)
    none = Epoch(Setting(0, 2), 4300.0, 0.78, worker_bytes=128 << 20, batch_bytes=1 << 16,
                 burstiness=1.5, load=Load(0.0035, 0.0035, 0.0009, 0.0009))
    first = tuning._observe(none, room)
    assert first is not None and first.new == 2 and tuning.tuner._trusted
    two = Epoch(first.setting, 3600.0, 0.05, 0.9, 0.05, 0.05, 128 << 20, 1 << 16, 1.5,
                start_s=share, start_share=share)
    mark = take_mark(tuning.rec, loader, setting=first.setting, fresh_pool=True)
    assert tuning._once(two, room, mark)  # a new pool that was not persistent: judged
    assert tuning._observe(two, room) is None  # within the bar: one more window
    assert tuning.keeping.kept is (share == 0.2)
    assert tuning.tuner._judge.trial == [pytest.approx(4500.0 if share == 0.2 else 3600.0)]


def test_a_deeper_queue_keeps_a_persistent_pool_and_its_batches(
        registry: CollectorRegistry, keep_log: pytest.LogCaptureFixture) -> None:
    """A prefetch_factor change between epochs of a persistent pool: the same workers,
    their queue deeper from the next epoch on, the batches torch's persistent loader
    gives (a rebuilt pool would have drawn a new base seed)."""
    from dataloader_exporter.core.tuner.types import Decision

    bare = torch.utils.data.DataLoader(Random(), batch_size=BATCH, shuffle=True,
                                       num_workers=2, persistent_workers=True,
                                       generator=torch.Generator().manual_seed(5))
    expected, _ = run(bare, epochs=3)
    tuned = instrument.DataLoader(Random(), batch_size=BATCH, shuffle=True, num_workers=2,
                                  persistent_workers=True, name="deeper", registry=registry,
                                  generator=torch.Generator().manual_seed(5),
                                  tune=("prefetch_factor",))
    torch.manual_seed(17)
    first = [x for batch in tuned for x in as_items(batch)]
    pool = compat.worker_pids(compat.persistent_iterator(tuned))
    tuning = tuned._instruments.tuning
    assert tuning is not None
    deeper = Decision(Setting(2, 4), "prefetch_factor", 2, 4, "bursty", "a test")
    assert tuning._apply(tuned, deeper, tuned._instruments.forget_workers) is None
    rest = [[x for batch in tuned for x in as_items(batch)] for _ in range(2)]
    assert [first, *rest] == expected
    assert compat.worker_pids(compat.persistent_iterator(tuned)) == pool
    # 4, or deeper where the tuner's own rule deepened it again: the same pool either way.
    assert compat.persistent_iterator(tuned)._prefetch_factor == tuned.prefetch_factor >= 4
    assert "prefetch_factor 2 -> 4: a test" in keep_log.text
    assert "start anew" not in keep_log.text


def test_a_kept_pool_is_seeded_as_torch_seeds_without_backends_the_build_lacks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """compat.manual_seed leaves the generators as torch.manual_seed does; it queues no
    seeding for a lazy device backend this build lacks, seeds one it has unless in a bad
    fork, and leaves it all to torch when torch's seeding names a backend it does not know."""
    compat.manual_seed(torch, 7)
    mine = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(mine, torch.rand(4))
    assert (torch.cuda in compat.lazy_backends(torch)) is torch.backends.cuda.is_built()

    class Backend:
        def __init__(self, bad_fork: bool) -> None:
            self.bad_fork, self.seeds = bad_fork, list[int]()

        def _is_in_bad_fork(self) -> bool:
            return self.bad_fork

        def manual_seed_all(self, seed: int) -> None:
            self.seeds.append(seed)

    built, forked = Backend(False), Backend(True)
    monkeypatch.setattr(compat, "_lazy_seeds", [built, forked])
    monkeypatch.setattr(compat, "_decided", True)
    compat.manual_seed(torch, 9)
    assert (built.seeds, forked.seeds) == ([9], [])

    calls: list[int] = []

    def newer(seed: int) -> None:  # a torch that seeds one more backend
        calls.append(seed)
        if seed < 0:
            torch.new_backend.manual_seed_all(seed)  # type: ignore[attr-defined]

    monkeypatch.setattr(torch.random, "_manual_seed_impl", newer)
    monkeypatch.setattr(compat, "_decided", False)
    compat.manual_seed(torch, 11)
    assert calls == [11] and compat._decided and compat._lazy_seeds is None
