"""The loader tuner in a real loop (instrument/tuner/loop.py): its changes happen between
iterators and never change the data. Each case runs torch's own DataLoader and the tuned
one side by side over the same dataset, seed and epochs, and compares every batch.
One module, though long: every case is that comparison, through the same epoch helpers."""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from support.helpers import scrape
from support.required import require_module
from support.torch_helpers import BurnDataset, RangeIterable, SleepDataset

from dataloader_exporter import instrument
from dataloader_exporter.core import advisor
from dataloader_exporter.core.tuner import judge as tuner_judge
from dataloader_exporter.core.tuner import model as tuner_model
from dataloader_exporter.instrument import compat, procstat
from dataloader_exporter.instrument.rank import local_world_size
from dataloader_exporter.instrument.tuner import epoch as tuner_epoch
from dataloader_exporter.instrument.tuner import loop as tuner_loop
from dataloader_exporter.instrument.tuner import order as tuner_order

pytestmark = [pytest.mark.torch, pytest.mark.slow]

EPOCHS = 4
BATCH = 8
N = 96  # 12 batches an epoch: past tuner_epoch.MIN_BATCHES
CPU = 0.002  # CPU seconds per sample: the loop waits on it without workers

Batches = list[list[torch.Tensor]]


def cores() -> int:
    return advisor.worker_cores(advisor.local_cpu(), local_world_size(), False)


def epochs(loader: Any, n: int = EPOCHS, after: Callable[[], None] | None = None
           ) -> tuple[Batches, list[int]]:
    """Every batch of n epochs (the samples' indices), and num_workers at each epoch."""
    seen: Batches = []
    workers: list[int] = []
    for _ in range(n):
        epoch = []
        it = iter(loader)
        workers.append(loader.num_workers)
        for batch in it:
            epoch.append(batch[1].clone())
        seen.append(epoch)
        if after is not None:
            after()
    return seen, workers


class ScriptedStat:
    """/proc/stat's busy and stolen ticks as the tuner and the workers' account read them
    (machine_ticks), scripted: the stolen ticks rise `stolen` times as fast as the busy."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, stolen: int) -> None:
        self.stolen = stolen
        self._ticks = itertools.count(1)
        for module in (procstat, tuner_epoch):
            monkeypatch.setattr(module, "machine_ticks", self)

    def __call__(self, path: str = "") -> tuple[int, int]:
        n = next(self._ticks) * 1000
        return n, self.stolen * n


def same(a: Batches, b: Batches) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True))


def stable_of(registry: CollectorRegistry, loader: str) -> float | None:
    """dataloader_tuner_stable of a loader (None: absent); its settings label checked."""
    found = [(dict(k[1]), v) for k, v in scrape(registry).items()
             if k[0] == "dataloader_tuner_stable" and dict(k[1])["loader"] == loader]
    assert len(found) <= 1, found
    if not found:
        return None
    assert found[0][0]["settings"] in ("num_workers", "num_workers,prefetch_factor",
                                       "prefetch_factor"), found
    return found[0][1]


@pytest.fixture
def tuner_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.INFO, logger="dataloader_exporter.instrument"):
        yield caplog


def test_a_shuffled_map_style_dataset_gives_the_same_batches_tuned_and_untuned(
        registry: CollectorRegistry, tuner_log: pytest.LogCaptureFixture) -> None:
    data = BurnDataset(N, cpu=CPU)
    bare = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True,
                                       generator=torch.Generator().manual_seed(7))
    tuned = instrument.DataLoader(data, batch_size=BATCH, shuffle=True, name="order",
                                  generator=torch.Generator().manual_seed(7),
                                  registry=registry, tune=True)
    expected, _ = epochs(bare)
    got, workers = epochs(tuned)
    assert workers[0] == 0 and workers[1] >= 1, workers  # the loop waited: workers added
    assert same(got, expected)
    assert f"dataloader 'order': num_workers 0 -> {workers[1]}: a batch takes" in tuner_log.text


def test_the_global_rng_and_the_order_are_the_same_when_the_loader_has_no_generator(
        registry: CollectorRegistry) -> None:
    data = BurnDataset(N, cpu=CPU)

    def run(loader: Any) -> tuple[Batches, list[float], list[int]]:
        torch.manual_seed(3)
        draws: list[float] = []
        seen, workers = epochs(loader, after=lambda: draws.append(torch.rand(1).item()))
        return seen, draws, workers

    expected, expected_draws, _ = run(torch.utils.data.DataLoader(data, batch_size=BATCH,
                                                                  shuffle=True))
    got, draws, workers = run(instrument.DataLoader(data, batch_size=BATCH, shuffle=True,
                                                    name="rng", registry=registry, tune=True))
    assert workers[1] >= 1
    assert same(got, expected) and draws == expected_draws


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("generator", [True, False], ids=["seeded", "global-rng"])
def test_a_persistent_pool_is_rebuilt_between_epochs_with_the_same_order(
        registry: CollectorRegistry, tuner_log: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch, generator: bool) -> None:
    """More persistent workers than the model allows on the rank's cores (one per core
    here): the tuner cuts them at the third iter() (a trial: undone if slower; the first
    epoch paid the pool's start, which the next ones do not: not judged), shutting the old
    pool down each time; the sampler's generator (or torch's global one)
    advances as if the pool had been reused."""
    monkeypatch.setattr(tuner_model, "MAX_PER_CPU", 1)
    # Judged at iter() only: a loaded machine's epoch can outlast a mid-epoch window.
    monkeypatch.setattr(tuner_loop, "WINDOW", 1e6)
    start = advisor.local_cpu().usable + 1
    data = BurnDataset(N, cpu=CPU / 4)

    def build(cls: Any, **kw: Any) -> Any:
        gen = torch.Generator().manual_seed(11) if generator else None
        return cls(data, batch_size=BATCH, shuffle=True, num_workers=start,
                   persistent_workers=True, generator=gen, **kw)

    def run(loader: Any) -> tuple[Batches, list[int], list[float]]:
        torch.manual_seed(5)
        bare_draws: list[float] = []
        seen, workers = epochs(loader, after=lambda: bare_draws.append(torch.rand(1).item()))
        return seen, workers, bare_draws

    expected, _, expected_draws = run(build(torch.utils.data.DataLoader))
    loader = build(instrument.DataLoader, name="pool", registry=registry, tune=True)
    pools: list[list[int]] = []
    torch.manual_seed(5)
    draws: list[float] = []

    def after() -> None:
        draws.append(torch.rand(1).item())
        pools.append(compat.worker_pids(compat.persistent_iterator(loader)))

    got, workers = epochs(loader, after=after)
    # Cut at the third epoch; the cut pool's first epoch is not judged either.
    assert workers[0] == workers[1] == start and workers[2] == workers[3] < start
    assert same(got, expected) and draws == expected_draws
    assert f"num_workers {start} -> {workers[2]}: {start} workers for" in tuner_log.text
    assert "(its persistent workers start anew)" in tuner_log.text
    assert [len(p) for p in pools] == workers
    assert not [pid for pid in pools[0] if _running(pid)]  # the cut pool is gone
    assert all(_running(pid) for pid in pools[-1])


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def test_an_iterable_datasets_worker_count_never_changes(
        registry: CollectorRegistry, tuner_log: pytest.LogCaptureFixture) -> None:
    start = cores() + 1  # over the budget: a map-style loader would be cut
    bare = torch.utils.data.DataLoader(RangeIterable(N), batch_size=BATCH, num_workers=start)
    tuned = instrument.DataLoader(RangeIterable(N), batch_size=BATCH, num_workers=start,
                                  name="stream", registry=registry, tune=True)

    def batches(loader: Any) -> tuple[Batches, list[int]]:
        seen: Batches = []
        workers = []
        for _ in range(EPOCHS):
            it = iter(loader)
            workers.append(loader.num_workers)
            seen.append([b.clone() for b in it])
        return seen, workers

    expected, _ = batches(bare)
    got, workers = batches(tuned)
    assert workers == [start] * EPOCHS
    assert same(got, expected)
    assert "num_workers=auto is not applied: its dataset is an IterableDataset" in \
        tuner_log.text


class SlowStream(torch.utils.data.IterableDataset[torch.Tensor]):
    """A stream whose items wait on storage: 2 ms each."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        import time

        for i in range(N):
            time.sleep(0.002)
            yield torch.tensor([i])


def test_an_iterable_dataset_gets_the_models_count_as_advice_for_the_next_run(
        registry: CollectorRegistry, tuner_log: pytest.LogCaptureFixture) -> None:
    loader = instrument.DataLoader(SlowStream(), batch_size=BATCH, name="stream-advice",
                                   registry=registry, tune=True)
    for _ in range(3):
        assert len(list(loader)) == N // BATCH
    assert loader.num_workers == 0
    said = re.findall(r"dataloader 'stream-advice': the tuner would set num_workers 0 -> "
                      r"(\d+) \(a batch takes .*\) but leaves it: its IterableDataset's "
                      r"worker count decides how its stream is split", tuner_log.text)
    assert len(said) == 1 and int(said[0]) >= 2, tuner_log.text
    assert f"DATALOADER_EXPORTER_SETTINGS=stream-advice.num_workers={said[0]}" in \
        tuner_log.text


def test_the_tuner_is_visible_in_the_metrics_and_says_how_to_keep_its_settings(
        registry: CollectorRegistry, tuner_log: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Settled once, between epochs: on a loaded machine a window mid-epoch, or the load's
    # swings read as a drift, would tune it again (their own tests: the window's, drift's).
    monkeypatch.setattr(tuner_loop, "WINDOW", 1e6)
    monkeypatch.setattr(tuner_judge, "DRIFT_WINDOWS", 10**6)
    data = BurnDataset(N, cpu=CPU)
    tuned = instrument.DataLoader(data, batch_size=BATCH, name="seen", registry=registry,
                                  tune=("num_workers",))
    plain = instrument.DataLoader(data, batch_size=BATCH, name="plain", registry=registry)
    epochs(plain, 1)
    epochs(tuned, 1)
    assert stable_of(registry, "seen") == 0.0
    epochs(tuned, 8)
    samples = scrape(registry)
    assert stable_of(registry, "seen") == 1.0
    assert ("dataloader_tuner_stable", (("loader", "seen"), ("rank", "0"),
                                        ("settings", "num_workers"))) in samples
    changes = {dict(k[1])["reason"]: v for k, v in samples.items()
               if k[0] == "dataloader_tuner_changes_total" and v}
    # (workers waiting for a CPU on a loaded machine: cut back, cpu-contention)
    assert changes.get("starved") == 1.0 and set(changes) <= {"starved", "reverted",
                                                               "cpu-contention"}
    assert not [k for k in samples if k[0].startswith("dataloader_tuner")
                and dict(k[1])["loader"] == "plain"]  # not tuned: no tuner series at all
    info = [dict(k[1]) for k in samples if k[0] == "dataloader_info"
            and dict(k[1])["loader"] == "seen"]
    assert info and info[0]["num_workers"] == str(tuned.num_workers)
    line = f"DATALOADER_EXPORTER_SETTINGS=seen.num_workers={tuned.num_workers}"
    assert tuner_log.text.count(line) == 1, tuner_log.text


def test_auto_in_the_settings_line_tunes_a_wrapped_torch_loader(
        registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATALOADER_EXPORTER_SETTINGS", "wrapped.num_workers=auto")
    loader = torch.utils.data.DataLoader(BurnDataset(N, cpu=CPU), batch_size=BATCH)
    assert instrument.wrap(loader, name="wrapped", registry=registry) is loader
    _, workers = epochs(loader, 2)
    assert workers[0] == 0 and workers[1] >= 1
    monkeypatch.setenv("DATALOADER_EXPORTER_SETTINGS", "*.num_workers=auto")
    built = instrument.DataLoader(BurnDataset(N, cpu=CPU), batch_size=BATCH, num_workers=0,
                                  name="built", registry=registry)
    assert built.num_workers == 0  # auto keeps the constructor's value to start from
    workers = epochs(built, 2)[1]
    assert workers[0] == 0 and workers[1] >= 1


def test_tune_takes_true_or_setting_names_only() -> None:
    data = BurnDataset(4)
    for bad in ("num_workers", ("batch_size",), ("num_workers", "pin_memory")):
        with pytest.raises(ValueError, match="tune: expected True, False or names"):
            instrument.DataLoader(data, tune=bad)  # type: ignore[arg-type]
    assert instrument.DataLoader(data, tune=["prefetch_factor"]).tune == (  # type: ignore[arg-type]
        "prefetch_factor",)


class Stubborn(torch.utils.data.DataLoader):  # type: ignore[type-arg]
    """A subclass that refuses num_workers once built."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "num_workers" and "num_workers" in self.__dict__:
            raise AttributeError("num_workers is fixed here")
        super().__setattr__(name, value)


def test_a_loader_that_refuses_a_change_keeps_training_with_its_own_settings(
        registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch,
        tuner_log: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("DATALOADER_EXPORTER_SETTINGS", "stubborn.num_workers=auto")
    data = BurnDataset(N, cpu=CPU)
    expected, _ = epochs(torch.utils.data.DataLoader(data, batch_size=BATCH))
    loader = instrument.wrap(Stubborn(data, batch_size=BATCH), name="stubborn",
                             registry=registry)
    got, workers = epochs(loader)
    assert workers == [0] * EPOCHS and same(got, expected)
    assert loader.prefetch_factor is None  # the half-made change was undone
    assert "the tuner failed and stops; the loader keeps its settings" in tuner_log.text
    assert stable_of(registry, "stubborn") is None  # no tuner runs: not exported


def test_a_long_epoch_gets_advice_not_a_change(
        registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch,
        tuner_log: pytest.LogCaptureFixture) -> None:
    """A loader whose pool cannot change mid-epoch (batches out of order)."""
    monkeypatch.setattr(tuner_loop, "LONG_EPOCH", 0.05)
    loader = instrument.DataLoader(BurnDataset(N, cpu=CPU), batch_size=BATCH, name="long",
                                   registry=registry, tune=True, in_order=False)
    it = iter(loader)
    for _ in range(10):
        next(it)
    generate_latest(registry)  # a scrape: its flush judges the epoch that is running
    assert loader.num_workers == 0  # the iterator under way is never changed
    said = re.search(r"dataloader 'long': the tuner would set num_workers 0 -> (\d+)",
                     tuner_log.text)
    assert said is not None, tuner_log.text
    assert "but leaves it: its epoch has run" in tuner_log.text
    assert f"DATALOADER_EXPORTER_SETTINGS=long.num_workers={said[1]}" in tuner_log.text
    assert sum(1 for _ in it) == N // BATCH - 10


def test_without_the_private_attributes_a_persistent_pool_is_left_to_torch() -> None:
    class Loader:
        persistent_workers = True

    loader, pool = Loader(), object()
    assert not compat.shut_down(loader, pool)  # no _iterator, no _shutdown_workers
    assert not hasattr(loader, "_iterator")
    assert compat.base_seed(pool) == 0


def test_a_sampler_that_draws_its_order_at_iter_gets_advice_and_the_same_batches(
        registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch,
        tuner_log: pytest.LogCaptureFixture) -> None:
    """torchdata's StatefulDataLoader draws its shuffled order when torch builds the
    sampler's iterator, which a multi-process iterator does twice: with a worker, the
    order would not be the one without. The tuner says what it would set and leaves it;
    the loop sees the untuned batches, and resumes from a state_dict() exactly."""
    sdl = require_module("torchdata.stateful_dataloader")
    monkeypatch.setenv("DATALOADER_EXPORTER_SETTINGS", "stateful.num_workers=auto")
    data = BurnDataset(N, cpu=CPU)

    def build(workers: int = 0) -> Any:
        return sdl.StatefulDataLoader(data, batch_size=BATCH, shuffle=True,
                                      num_workers=workers,
                                      generator=torch.Generator().manual_seed(2))

    expected, _ = epochs(build(), 3)
    with_a_worker, _ = epochs(build(1), 3)
    assert not same(with_a_worker, expected)  # why the tuner must not start workers here
    loader = instrument.wrap(build(), name="stateful", registry=registry)
    got, workers = epochs(loader, 2)
    assert workers == [0, 0] and same(got, expected[:2])
    assert re.search(r"the tuner would set num_workers 0 -> \d+", tuner_log.text)
    assert "its sampler (BatchSampler) draws its order when an iterator is built, so " \
           "starting workers would change the order of the batches" in tuner_log.text
    assert stable_of(registry, "stateful") is None  # it only advises: not a tuned loader
    it = iter(loader)
    head = [next(it)[1].clone() for _ in range(5)]
    resumed = build()
    resumed.load_state_dict(loader.state_dict())
    assert same([head + [b[1].clone() for b in resumed]], [expected[2]])


class EagerSampler(torch.utils.data.Sampler[int]):
    """Draws its permutation when its iterator is built (a plain __iter__)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(self.n).tolist())


def test_which_samplers_let_a_new_pool_keep_the_order() -> None:
    accelerate = require_module("accelerate.data_loader")
    data = list(range(40))
    lazy = [torch.utils.data.DataLoader(data, batch_size=4, shuffle=True),
            torch.utils.data.DataLoader(data, batch_size=None),
            torch.utils.data.DataLoader(data, batch_size=4, sampler=torch.utils.data.
                                        DistributedSampler(data, num_replicas=2, rank=0)),
            torch.utils.data.DataLoader(data, batch_sampler=accelerate.BatchSamplerShard(
                torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(data), 4, False),
                2, 0))]
    assert [tuner_order.order_bound(loader, 0) for loader in lazy] == [None] * 4
    # torch's BatchSampler builds its sampler's iterator at its first batch: lazy even
    # over an eager sampler. Without batching, the eager sampler is torch's to iterate.
    assert tuner_order.order_bound(torch.utils.data.DataLoader(
        data, batch_size=4, sampler=EagerSampler(40)), 0) is None
    eager = torch.utils.data.DataLoader(data, batch_size=None, sampler=EagerSampler(40))
    assert "EagerSampler" in (tuner_order.order_bound(eager, 0) or "")
    assert tuner_order.order_bound(torch.utils.data.DataLoader(
        data, batch_size=None, sampler=EagerSampler(40), num_workers=1), 1) is None


def test_the_first_epoch_with_workers_has_their_shares_with_no_reader(
        registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    """No scrape and no snapshot writer: the tuner samples the workers itself (at an
    epoch's first batch and at its end), and the epoch that started the first worker
    has their running and waiting shares (baseline 0), so a larger machine goes on to
    2 workers and more."""
    # Judged at iter() only: a loaded machine's epoch can outlast a mid-epoch window.
    monkeypatch.setattr(tuner_loop, "WINDOW", 1e6)
    loader = instrument.DataLoader(BurnDataset(160, cpu=0.01), batch_size=8, name="shares",
                                   registry=registry, tune=("num_workers",))
    epochs(loader, 1)
    tuning_ = loader._instruments.tuning
    assert tuning_ is not None
    seen: list[Any] = []
    observe = tuning_.tuner.observe
    tuning_.tuner.observe = lambda e, b: (seen.append(e), observe(e, b))[1]  # type: ignore[method-assign]
    epochs(loader, 1)  # judges the epoch without workers: one is started
    iter(loader)  # judges the epoch with it
    assert seen[0].setting.workers == 0 and seen[1].setting.workers >= 1, seen
    assert seen[0].running is None  # no workers: no shares
    assert seen[1].running is not None and seen[1].waiting_cpu is not None, seen[1]
    # CPU-bound: on a CPU or, on a busy machine, waiting for one; not blocked.
    assert seen[1].running + seen[1].waiting_cpu > 0.5, seen[1]


class MainProcessOnly(BurnDataset):
    """Cannot run in a worker (as a dataset that touches CUDA after the fork cannot)."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError("this dataset cannot run in a worker process")
        return super().__getitem__(i)


def test_a_dataset_that_cannot_run_in_a_worker_keeps_training_without_one(
        registry: CollectorRegistry, tuner_log: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuner's first worker fails the first batch: the same epoch starts again without
    workers, its RNGs as before, so the loop sees exactly the untuned batches (the same
    failure mid-epoch: test_a_pool_that_fails_mid_epoch...)."""
    # Judged at iter() only: a loaded machine's epoch can outlast a mid-epoch window.
    monkeypatch.setattr(tuner_loop, "WINDOW", 1e6)
    data = MainProcessOnly(N, cpu=CPU)
    expected, _ = epochs(torch.utils.data.DataLoader(
        data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(4)))
    loader = instrument.DataLoader(data, batch_size=BATCH, shuffle=True, name="main-only",
                                   generator=torch.Generator().manual_seed(4),
                                   registry=registry, tune=True)
    got, workers = epochs(loader)
    assert workers[0] == 0 and workers[1] >= 1 and loader.num_workers == 0  # tried, and back
    assert same(got, expected)
    assert f"dataloader 'main-only': num_workers {workers[1]} -> 0: its workers failed " \
           "(RuntimeError: this dataset cannot run in a worker process); the epoch starts " \
           "again without them and the tuner adds none" in tuner_log.text
    samples = scrape(registry)
    assert samples[("dataloader_tuner_changes_total", (
        ("loader", "main-only"), ("rank", "0"), ("reason", "reverted"),
        ("setting", "num_workers")))] == 1.0
    assert samples[("dataloader_workers_lost_total", (("loader", "main-only"),
                                                       ("rank", "0")))] == 0.0
    assert stable_of(registry, "main-only") == 1.0


SPAWN_JOB = """
import json, sys, torch
torch.multiprocessing.set_start_method("spawn", force=True)
sys.path.insert(0, sys.argv[1])
from support.torch_helpers import BurnDataset
from dataloader_exporter import instrument

class Unpicklable(BurnDataset):
    def __init__(self, n):
        super().__init__(n, cpu=0.002)
        self.transform = lambda x: x  # spawn cannot pickle it: no worker can start

def run(loader):
    out = []
    for _ in range(3):
        it = iter(loader)
        out.append([loader.num_workers, [b[1].tolist() for b in it]])
    return out

g = lambda: torch.Generator().manual_seed(9)
bare = run(torch.utils.data.DataLoader(Unpicklable(96), batch_size=8, shuffle=True,
                                       generator=g()))
tuned = run(instrument.DataLoader(Unpicklable(96), batch_size=8, shuffle=True,
                                  generator=g(), name="spawned", tune=True))
print(json.dumps({"bare": bare, "tuned": tuned}))
"""


def test_a_pool_that_cannot_start_under_spawn_keeps_training_without_one(
        tmp_path: Any) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "spawn_job.py"
    script.write_text(SPAWN_JOB)
    result = subprocess.run([sys.executable, str(script), str(Path(__file__).parent)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert [e[1] for e in out["tuned"]] == [e[1] for e in out["bare"]]
    assert [e[0] for e in out["tuned"]] == [0, 0, 0]  # tried at the 2nd iter(), and back
    assert re.search(r"dataloader 'spawned': num_workers \d+ -> 0: its workers failed",
                     result.stderr), result.stderr


def test_a_loader_sharing_its_name_with_another_is_not_judged_on_their_mixed_figures(
        registry: CollectorRegistry, tuner_log: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Judged at iter() only: a mid-epoch window that ends inside train's epoch (one
    # over WINDOW seconds on a loaded machine) holds train's batches alone, and may be.
    monkeypatch.setattr(tuner_loop, "WINDOW", 1e6)
    data = BurnDataset(N, cpu=CPU)
    train = instrument.DataLoader(data, batch_size=BATCH, registry=registry, tune=True)
    val = instrument.DataLoader(data, batch_size=BATCH, registry=registry)  # also "default"
    for _ in range(3):
        for _ in train:
            pass
        for _ in val:
            pass
    assert train.num_workers == 0  # never judged: val's batches were in every window
    assert "dataloader 'default': the tuner cannot judge an epoch while another loader of " \
           "the same name runs in it" in tuner_log.text


def test_an_iterable_dataset_with_persistent_workers_is_only_advised(
        registry: CollectorRegistry, tuner_log: pytest.LogCaptureFixture) -> None:
    loader = instrument.DataLoader(RangeIterable(N), batch_size=BATCH, num_workers=1,
                                   persistent_workers=True, name="kept", registry=registry,
                                   tune=True)
    bare = torch.utils.data.DataLoader(RangeIterable(N), batch_size=BATCH, num_workers=1,
                                       persistent_workers=True)
    got = [[b.clone() for b in loader] for _ in range(3)]
    expected = [[b.clone() for b in bare] for _ in range(3)]
    assert same(got, expected) and loader.prefetch_factor == 2
    assert "its IterableDataset's stream lives in its persistent workers" in tuner_log.text
    assert stable_of(registry, "kept") is None


class Bursty(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Instant samples, but every 8th read in a process waits 60 ms (a slow read): with a
    15 ms step the worker keeps up on average (60 ms and 7 quick reads in every 120 ms, with
    room for their cost on a loaded machine) and the loop waits in bursts, an eighth of its
    fetches, whatever the shuffle draws."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.reads = 0  # in each process (a forked worker counts its own)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.reads += 1
        if self.reads % 8 == 0:
            time.sleep(0.06)
        return torch.tensor([i])


def test_a_long_epoch_of_a_stateful_loader_gets_its_queue_deepened_mid_epoch(
        registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch,
        tuner_log: pytest.LogCaptureFixture) -> None:
    """One long epoch (LONG_EPOCH made short; judged once it holds 48 batches, six bursts,
    as a real long epoch holds thousands): torchdata's StatefulDataLoader resumes
    exactly from its state_dict(), so the tuner deepens its queue mid-epoch, through
    state_dict(), the new prefetch_factor and load_state_dict(); the loop sees the very
    batches of the untuned loader, and the old pool's worker is gone."""
    sdl = require_module("torchdata.stateful_dataloader")
    monkeypatch.setattr(tuner_loop, "LONG_EPOCH", 0.5)
    monkeypatch.setattr(tuner_epoch, "MIN_BATCHES", 48)  # 6 bursts in a window at least
    monkeypatch.setenv("DATALOADER_EXPORTER_SETTINGS", "long-stateful.prefetch_factor=auto")
    tuner_log.set_level(logging.DEBUG, logger="dataloader_exporter.instrument")  # figures

    def build() -> Any:
        return sdl.StatefulDataLoader(Bursty(240), batch_size=1, shuffle=True,
                                      num_workers=1, generator=torch.Generator().manual_seed(5))

    expected = [b.clone() for b in build()]
    loader = instrument.wrap(build(), name="long-stateful", registry=registry)
    it = iter(loader)
    got, prefetch, pids = [], [], []
    for b in it:
        got.append(b.clone())
        prefetch.append(loader.prefetch_factor)
        pids.append(tuple(compat.worker_pids(compat.persistent_iterator(loader) or it._it)))
        time.sleep(0.015)  # a step: on average the worker keeps up, only its bursts do not
    assert same([got], [expected])
    # Deepened mid-epoch (and back if that trial did not pay, as it may not here).
    assert prefetch[0] == 2 and 4 in prefetch, (sorted(set(prefetch)), tuner_log.text)
    assert "dataloader 'long-stateful': prefetch_factor 2 -> 4: the loop waited" in \
        tuner_log.text
    assert "(mid-epoch: resumed from its state_dict())" in tuner_log.text
    first = pids[0]
    assert first and first != pids[-1] and not [p for p in first if _running(p)]


def indices(loader: Any, epochs_: int = 2) -> tuple[list[int], list[int]]:
    """The sample indices the loop sees over `epochs_` epochs, and num_workers at each
    batch."""
    seen, workers = [], []
    for _ in range(epochs_):
        for _x, i in loader:
            seen.extend(i.tolist())
            workers.append(loader.num_workers)
    return seen, workers


@pytest.mark.parametrize(("persistent", "stolen"), [(False, 0), (True, 0), (True, 1)],
                         ids=["from-none", "persistent", "persistent-half-stolen"])
def test_a_map_style_loader_changes_its_pool_mid_epoch_with_the_same_order_and_rngs(
        registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch,
        tuner_log: pytest.LogCaptureFixture, persistent: bool, stolen: int) -> None:
    """Samples that wait on storage: within the first epoch the tuner moves straight to
    the model's count (past one worker, past the cores when they are blocked), mid-epoch;
    the loop sees the untuned loader's indices in the same order, and the loader's
    generator and torch's RNG are where the untuned run leaves them. So too where the
    machine's CPUs lose half their busy time to steal (/proc/stat, scripted): the time the
    workers lose is their CPU's cost, not a queue for the cores that holds more back."""
    monkeypatch.setattr(tuner_loop, "WINDOW", 0.3)
    tuner_log.set_level(logging.DEBUG, logger="dataloader_exporter.instrument")  # figures
    start = 1 if persistent else 0
    data = SleepDataset(240, delay=0.004)  # mostly asleep: blocked

    def run(cls: Any, **kw: Any) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
        torch.manual_seed(8)
        gen = torch.Generator().manual_seed(3)
        loader = cls(data, batch_size=4, shuffle=True, generator=gen, num_workers=start,
                     persistent_workers=persistent, **kw)
        seen, workers = indices(loader)
        return seen, workers, gen.get_state(), torch.get_rng_state()

    bare = run(torch.utils.data.DataLoader)
    if stolen:
        ScriptedStat(monkeypatch, stolen)
    tuned = run(instrument.DataLoader, name="mid", registry=registry, tune=True)
    assert tuned[0] == bare[0]
    assert torch.equal(tuned[2], bare[2]) and torch.equal(tuned[3], bare[3])
    first_epoch = tuned[1][:len(tuned[1]) // 2]
    assert first_epoch[0] == start and max(first_epoch) > max(start, 1), (first_epoch,
                                                                          tuner_log.text)
    assert re.search(rf"dataloader 'mid': num_workers {start} -> \d+: a batch takes [\d.]+ "
                     r"ms to make \(\d+% of it on a CPU\).*\(mid-epoch\)", tuner_log.text)


def test_a_pool_that_fails_mid_epoch_gives_its_batches_back_to_the_loop(
        registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch,
        tuner_log: pytest.LogCaptureFixture) -> None:
    """A dataset that cannot run in a worker: the tuner's first pool, started mid-epoch,
    fails its first batch; the indices it took are handed to the loop without workers,
    so the epoch goes on with exactly the untuned batches, and no worker is tried again."""
    monkeypatch.setattr(tuner_loop, "WINDOW", 0.3)
    data = MainProcessOnly(480, cpu=0.002)

    def build(cls: Any, **kw: Any) -> Any:
        return cls(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(6),
                   **kw)

    expected, _ = indices(build(torch.utils.data.DataLoader))
    loader = build(instrument.DataLoader, name="mid-fail", registry=registry, tune=True)
    got, workers = indices(loader)
    assert got == expected
    assert set(workers) == {0}
    assert re.search(r"dataloader 'mid-fail': num_workers \d+ -> 0: its workers failed "
                     r"\(RuntimeError: this dataset cannot run in a worker process\); the "
                     r"epoch goes on without them", tuner_log.text), tuner_log.text
    assert stable_of(registry, "mid-fail") == 1.0


def test_an_abandoned_tuned_iterator_ends_its_workers_without_the_garbage_collector(
        registry: CollectorRegistry) -> None:
    """The loop breaks out of an epoch: the tuned iterator (which can change its pool
    mid-epoch) is freed as torch's is, its workers shut down at once, with no reference
    cycle left for the garbage collector (a fork before it runs would copy the pool's
    iterator into the new workers)."""
    import gc

    loader = instrument.DataLoader(SleepDataset(400, delay=0.001), batch_size=4, num_workers=2,
                                   name="abandon", registry=registry, tune=True)
    it = iter(loader)
    next(it)
    pids = compat.worker_pids(it._it)
    assert len(pids) == 2
    gc.disable()
    try:
        del it
        assert not [pid for pid in pids if _running(pid)]
    finally:
        gc.enable()


class SlowingDataset(SleepDataset):
    """SleepDataset whose delay is read, per sample, from shared memory: the main process
    slows the storage down under the running workers (the pool is forked after it)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.shared = multiprocessing.get_context("fork").Value("d", 0.0, lock=False)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.shared.value:
            time.sleep(self.shared.value)
        return super().__getitem__(i)


def test_a_settled_loader_is_watched_mid_epoch_and_tuned_again_when_storage_slows(
        registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch,
        tuner_log: pytest.LogCaptureFixture) -> None:
    """One long epoch: the tuner settles on fast samples; the storage then slows down
    under it; the settled rate's drift is seen in windows of that same epoch, and the
    tuner moves again mid-epoch, with the untuned loader's order."""
    monkeypatch.setattr(tuner_loop, "WINDOW", 0.3)
    data = SlowingDataset(200_000)

    def build(cls: Any, **kw: Any) -> Any:
        return cls(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(4),
                   **kw)

    loader = build(instrument.DataLoader, name="drift", registry=registry, tune=True)
    seen: list[int] = []
    deadline = time.monotonic() + 60
    slowed_at = None
    for n, (_x, i) in enumerate(loader):
        seen.extend(i.tolist())
        if slowed_at is None and n % 16 == 0 and stable_of(registry, "drift") == 1.0:
            slowed_at = len(tuner_log.records)
            data.shared.value = 0.004  # 4 ms a sample from now on, as on a busy NFS
        after = tuner_log.records[slowed_at:] if slowed_at is not None else []
        if any("(mid-epoch)" in r.getMessage() for r in after) or time.monotonic() > deadline:
            break
    assert slowed_at is not None, tuner_log.text  # it settled within the epoch
    after = "\n".join(r.getMessage() for r in tuner_log.records[slowed_at:])
    assert "fell 20% below the rate it settled at" in after, tuner_log.text
    assert re.search(r"dataloader 'drift': num_workers \d+ -> \d+: .*\(mid-epoch\)", after), after
    data.shared.value = 0.0
    bare = iter(build(torch.utils.data.DataLoader))
    expected = [j for _ in range(len(seen) // 4) for j in next(bare)[1].tolist()]
    assert seen == expected


def test_without_workers_the_time_the_hypervisor_took_is_not_read_as_blocking(
        registry: CollectorRegistry, tuner_log: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples that burn 2 ms of CPU and sleep 2 ms: without workers, on a machine without
    steal, the tuner's model sees a batch half on a CPU. Where the machine's CPUs lose two
    thirds of their busy time to steal, the loop thread lost twice the time it ran to the
    hypervisor: that is the batch's CPU cost too, and the batch reads as all CPU.
    /proc/stat is scripted for both: this machine's own steal is not known."""
    data = BurnDataset(N, cpu=0.002)
    data.delay = 0.002
    share = re.compile(r"dataloader '(\w+)': num_workers 0 -> \d+: a batch takes [\d.]+ ms "
                       r"to make \((\d+)% of it on a CPU\)")

    def first_share(name: str) -> int:
        loader = instrument.DataLoader(data, batch_size=BATCH, name=name, registry=registry,
                                       tune=("num_workers",))
        epochs(loader, 2)  # the second iter() judges the first epoch
        found = {m[1]: int(m[2]) for m in share.finditer(tuner_log.text)}
        assert name in found, tuner_log.text
        return found[name]

    stat = ScriptedStat(monkeypatch, 0)
    assert 30 <= first_share("bare") <= 70
    stat.stolen = 2  # stolen ticks rise twice as fast as busy ones
    assert first_share("stolen") >= 85


def test_the_tuners_own_start_is_not_taken_from_the_time_the_loop_waited(
        registry: CollectorRegistry, tuner_log: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuner starts at the first iter(), before its mark: on a loaded machine its start
    (imports, the first reading) can outlast an epoch. The epoch's stall counts from its
    first batch after the mark, so that start is in neither the wall nor the wait: samples
    that sleep 2 ms and a loop that does nothing read as a loop waiting nearly all its time,
    and the tuner adds workers."""
    start = tuner_loop.LoaderTuning.__init__

    def slow_start(self: tuner_loop.LoaderTuning, *args: Any, **kwargs: Any) -> None:
        time.sleep(0.5)  # past the epoch's 12 batches of 16 ms
        start(self, *args, **kwargs)

    monkeypatch.setattr(tuner_loop.LoaderTuning, "__init__", slow_start)
    loader = instrument.DataLoader(SleepDataset(N, delay=0.002), batch_size=BATCH,
                                   name="slowstart", registry=registry, tune=("num_workers",))
    tuner_log.set_level(logging.DEBUG, logger="dataloader_exporter.instrument")  # figures
    epochs(loader, 2)  # the second iter() judges the first epoch
    judged = re.search(r"dataloader 'slowstart': \d+ batches in [\d.]+ s, to be judged: "
                       r"Epoch\(setting=Setting\(workers=0, .*?stall=([\d.]+)", tuner_log.text)
    assert judged is not None, tuner_log.text
    assert float(judged[1]) >= 0.5, tuner_log.text
    assert "dataloader 'slowstart': num_workers 0 -> " in tuner_log.text, tuner_log.text
