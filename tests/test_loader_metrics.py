"""Each trainer metric against known truth, on real DataLoaders and real workers."""

from __future__ import annotations

import time

import pytest
import torch
from prometheus_client import CollectorRegistry
from support.helpers import refreshes, scrape, value
from support.torch_helpers import BurnDataset, SleepDataset

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.core.facts.shm import SHM_PATH, shm_space
from dataloader_exporter.instrument.hotpath.recorder import DurationHistogram
from dataloader_exporter.instrument.loader_collector import _exported

pytestmark = pytest.mark.torch

L = {"loader": "t", "rank": "0"}
DEV_SHM = str(shm_space(SHM_PATH).size)  # the trainer's own /dev/shm, in dataloader_info
FETCH = {**L, "phase": cat.PHASE_FETCH}
TRANSFER = {**L, "phase": cat.PHASE_TRANSFER}


def test_fetch_time_sum_matches_a_dataset_that_sleeps_a_known_time(
        registry: CollectorRegistry) -> None:
    delay, batch, batches = 0.01, 2, 10
    loader = instrument.DataLoader(SleepDataset(batch * batches, delay), batch_size=batch,
                                   name="t", registry=registry)
    for _ in loader:
        pass
    truth = delay * batch * batches
    fetch = value(registry, cat.TIME.name + "_sum", **FETCH)
    assert fetch is not None
    # Sleeps never end early; a loaded machine's interpreter lock can end them late.
    assert truth * 0.99 < fetch < truth * 1.5, (fetch, truth)
    assert value(registry, cat.TIME.name + "_count", **FETCH) == batches


def test_step_time_is_the_time_spent_between_batches(registry: CollectorRegistry) -> None:
    step, batches = 0.01, 8
    loader = instrument.DataLoader(SleepDataset(batches), batch_size=1, name="t",
                                   registry=registry)
    for _ in loader:
        time.sleep(step)
    total = value(registry, cat.STEP.name + "_sum", **L)
    # The sleep after the last batch is not between two batches.
    truth = step * (batches - 1)
    assert total is not None and truth * 0.99 < total < truth * 1.3, (total, truth)
    assert value(registry, cat.STEP.name + "_count", **L) == batches - 1
    fetch = value(registry, cat.TIME.name + "_sum", **FETCH)
    assert fetch is not None and fetch < truth / 5


def test_step_buckets_are_the_catalogues_decades_and_count_each_step_once(
        registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(SleepDataset(7), batch_size=1, name="t", registry=registry)
    for i, _ in enumerate(loader):
        time.sleep(0.02 if i % 2 else 0.0)  # 3 steps of 20 ms, 3 far under 10 ms
    buckets = {labels: v for (k, labels), v in scrape(registry).items()
               if k == cat.STEP.name + "_bucket"}
    les = {dict(labels)["le"]: v for labels, v in buckets.items()}
    assert list(les) == [*(repr(b) for b in cat.STEP_BUCKETS), "+Inf"]
    # A loaded machine may stretch a short step, never shorten a sleep.
    assert les["0.01"] <= 3 and les["0.1"] == 6 and les["+Inf"] == 6


def test_steps_binned_finer_export_the_catalogues_buckets_exactly() -> None:
    steps_ns = [200_000, 2_000_000, 5_000_000, 20_000_000, 2_500_000_000, 20_000_000_000]
    fine, exported = DurationHistogram(cat.STEP_BINS), DurationHistogram(cat.STEP_BUCKETS)
    fine.add_ns(steps_ns)
    exported.add_ns(steps_ns)
    les = frozenset((*(repr(b) for b in cat.STEP_BUCKETS), "+Inf"))
    assert set(cat.STEP_BUCKETS) <= set(cat.STEP_BINS)
    assert _exported(fine.buckets(), les) == _exported(exported.buckets(), les) \
        == exported.buckets()


def test_counters_count_batches_samples_and_epochs_exactly(registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(SleepDataset(10), batch_size=4, name="t", registry=registry)
    for _ in range(3):
        for _ in loader:
            pass
    assert value(registry, cat.BATCHES.name, **L) == 3 * 3  # 4 + 4 + 2 per epoch
    assert value(registry, cat.SAMPLES.name, **L) == 30
    assert value(registry, cat.EPOCHS.name, **L) == 3
    assert value(registry, cat.FIRST_BATCH.name + "_count", **L) == 3


def test_first_batch_time_includes_the_wait_for_the_first_batch(
        registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(SleepDataset(4, 0.05), batch_size=2, name="t",
                                   registry=registry)
    for _ in loader:
        pass
    first = value(registry, cat.FIRST_BATCH.name + "_sum", **L)
    assert first is not None and 0.1 <= first < 0.2, first
    bucket = value(registry, cat.FIRST_BATCH.name + "_bucket", **L, le="+Inf")
    assert bucket == 1


def test_last_batch_timestamp_is_the_wall_time_of_the_last_batch(
        registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(SleepDataset(3), batch_size=1, name="t", registry=registry)
    for _ in loader:
        handed_out = time.time()
    time.sleep(0.2)
    ts = value(registry, cat.LAST_BATCH.name, **L)
    assert ts is not None and abs(ts - handed_out) < 0.05


def test_batch_bytes_are_the_tensor_bytes_of_a_batch(registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(SleepDataset(8, width=16), batch_size=4, name="t",
                                   registry=registry)
    for _ in loader:
        pass
    # 4 samples x 16 float32 + 4 int64 labels.
    assert value(registry, cat.BATCH_BYTES.name, **L) == 4 * 16 * 4 + 4 * 8


def test_to_device_moves_nested_batches_and_counts_bytes_and_time(
        registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(SleepDataset(4, width=8), batch_size=2, name="t",
                                   registry=registry)
    moved = []
    for x, y in loader:
        batch = {"x": x, "pair": (y, [x]), "name": "kept"}
        moved.append(loader.to_device(batch, "meta"))
    out = moved[0]
    assert out["x"].device.type == "meta" and out["pair"][1][0].device.type == "meta"
    assert out["pair"][0].device.type == "meta" and out["name"] == "kept"
    per_batch = 2 * 8 * 4 * 2 + 2 * 8  # x twice, y once
    assert value(registry, cat.TRANSFER_BYTES.name, **L) == 2 * per_batch
    assert value(registry, cat.TIME.name + "_count", **TRANSFER) == 2


def test_to_device_leaves_bytes_alone_when_tensors_are_already_there(
        registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(SleepDataset(2), batch_size=2, name="t", registry=registry)
    for x, _ in loader:
        assert instrument.to_device(x, "cpu", loader=loader) is x
    assert value(registry, cat.TRANSFER_BYTES.name, **L) == 0
    assert value(registry, cat.TIME.name + "_count", **TRANSFER) == 1


def test_info_metric_carries_the_effective_configuration(registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(SleepDataset(4), batch_size=2, num_workers=2,
                                   persistent_workers=True, name="t", registry=registry)
    for _ in loader:
        pass
    info = {"num_workers": "2", "batch_size": "2", "prefetch_factor": "2",
            "pin_memory": "false", "persistent_workers": "true", "gpu_uuid": "",
            "dev_shm_bytes": DEV_SHM}
    assert value(registry, cat.INFO.name, **L, **info) == 1
    assert value(registry, cat.WORKERS_CONFIGURED.name, **L) == 2


@pytest.mark.parametrize("persistent", [True, False])
def test_worker_cpu_time_and_samples_add_up_to_the_work_done(
        registry: CollectorRegistry, persistent: bool) -> None:
    n, cpu = 16, 0.01
    loader = instrument.DataLoader(BurnDataset(n, cpu), batch_size=2, num_workers=2,
                                   persistent_workers=persistent, name="t", registry=registry)
    for _ in range(2):
        for _ in loader:
            pass
    samples = scrape(registry)
    used = [v for (k, labels), v in samples.items() if k == cat.WORKER_CPU.name]
    counts = [v for (k, labels), v in samples.items() if k == cat.WORKER_SAMPLES.name]
    assert len(used) == 2 and sum(counts) == 2 * n and min(counts) > 0
    truth = 2 * n * cpu
    # Forked workers' CPU clocks start at zero, but each worker's start-up is CPU too (tens
    # of ms on these machines): allow 0.1 s per worker process, less than a double count.
    processes = 2 if persistent else 4
    assert truth * 0.95 < sum(used) < truth * 1.25 + 0.1 * processes, (used, truth)
    # A worker's last batch is not exported (nothing reads it): the loader's is.
    assert not [k for k, _ in samples if k in {m.name for m in cat.RETIRED}]
    assert abs(value(registry, cat.LAST_BATCH.name, **L) - time.time()) < 30


def test_workers_active_counts_live_worker_processes(registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(SleepDataset(8), batch_size=1, num_workers=2,
                                   persistent_workers=True, name="t", registry=registry)
    it = iter(loader)
    next(it)
    assert value(registry, cat.WORKERS_ACTIVE.name, **L) == 2
    for _ in it:
        pass
    del it, loader


def test_workers_active_drops_to_zero_when_non_persistent_workers_finish(
        registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(SleepDataset(4), batch_size=1, num_workers=2,
                                   name="t", registry=registry)
    it = iter(loader)
    for _ in it:
        pass
    refreshes(loader)  # the exhausted iterator still held, its workers shut down by torch
    assert value(registry, cat.WORKERS_ACTIVE.name, **L) == 0
    assert value(registry, cat.WORKERS_LOST.name, **L) == 0


def test_wrap_times_a_loader_it_did_not_build(registry: CollectorRegistry) -> None:
    inner = torch.utils.data.DataLoader(SleepDataset(6, 0.01), batch_size=2, num_workers=2,
                                        persistent_workers=True)
    loader = instrument.wrap(inner, name="t", registry=registry)
    it = iter(loader)
    next(it)
    assert value(registry, cat.WORKERS_ACTIVE.name, **L) == 2
    rest = list(it)
    assert len(rest) == 2
    assert value(registry, cat.BATCHES.name, **L) == 3
    assert value(registry, cat.SAMPLES.name, **L) == 6
    assert value(registry, cat.WORKERS_CONFIGURED.name, **L) == 2
    fetch = value(registry, cat.TIME.name + "_sum", **FETCH)
    assert fetch is not None and fetch > 0


def test_two_loaders_at_once_keep_separate_series(registry: CollectorRegistry) -> None:
    a = instrument.DataLoader(SleepDataset(6), batch_size=2, name="a", registry=registry)
    b = instrument.DataLoader(SleepDataset(6), batch_size=3, name="b", registry=registry)
    for _ in zip(a, b, strict=False):
        pass
    # zip asks `a` for its third batch before it finds `b` exhausted.
    assert value(registry, cat.BATCHES.name, loader="a", rank="0") == 3
    assert value(registry, cat.BATCHES.name, loader="b", rank="0") == 2
    assert value(registry, cat.SAMPLES.name, loader="a", rank="0") == 6
    assert value(registry, cat.SAMPLES.name, loader="b", rank="0") == 6


def test_rank_label_comes_from_the_rank_environment_variable(
        registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    loader = instrument.DataLoader(SleepDataset(2), batch_size=1, name="t", registry=registry)
    for _ in loader:
        pass
    assert value(registry, cat.BATCHES.name, loader="t", rank="3") == 2


class FakeProperties:
    """What torch.cuda.get_device_properties(dev) returns, for its uuid only."""

    def __init__(self, uuid: object) -> None:
        self.uuid = uuid


def test_the_gpu_a_rank_feeds_is_named_by_its_nvml_uuid() -> None:
    from dataloader_exporter.instrument.rank_gpu import gpu_uuid

    dev = torch.device("cuda", 0)
    uuid = "6e1a4c2d-3b1f-9a0e-55c1-0d2b7f8e9a10"
    assert gpu_uuid(dev, lambda d: FakeProperties(uuid)) == f"GPU-{uuid}"
    assert gpu_uuid(dev, lambda d: FakeProperties(f"MIG-{uuid}")) == f"MIG-{uuid}"
    assert gpu_uuid(dev, lambda d: FakeProperties("")) == ""
    assert gpu_uuid(dev) == ""  # no GPU here: torch raises, and the UUID stays unknown


def test_dataloader_info_carries_the_gpu_uuid_once_batches_go_to_cuda(
        registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(SleepDataset(4), batch_size=2, name="t", registry=registry)
    for _ in loader:
        pass
    assert value(registry, cat.INFO.name, **L, num_workers="0", batch_size="2",
                 prefetch_factor="", pin_memory="false", persistent_workers="false",
                 gpu_uuid="", dev_shm_bytes=DEV_SHM) == 1
    # No GPU here: to_device's CUDA branch calls exactly this with the device's UUID.
    loader._instruments.note_gpu("GPU-6e1a4c2d")
    for _ in loader:
        pass
    assert value(registry, cat.INFO.name, **L, num_workers="0", batch_size="2",
                 prefetch_factor="", pin_memory="false", persistent_workers="false",
                 gpu_uuid="GPU-6e1a4c2d", dev_shm_bytes=DEV_SHM) == 1
