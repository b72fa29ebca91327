"""The configuration line and each once-only warning, on real loaders."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry
from support.torch_helpers import SleepDataset

from dataloader_exporter import instrument
from dataloader_exporter.core import advisor
from dataloader_exporter.core.advisor import Cpu
from dataloader_exporter.core.facts.shm import ShmSpace
from dataloader_exporter.instrument.preflight import (
    LoaderConfig,
    Preflight,
    shm_needed,
    shm_size_advice,
)

pytestmark = pytest.mark.torch

MiB = 1024**2


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def run(loader: instrument.DataLoader, epochs: int = 1) -> None:
    for _ in range(epochs):
        for _ in loader:
            pass


def test_first_iteration_logs_the_effective_configuration_once(
        registry: CollectorRegistry, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dataloader_exporter.instrument")
    run(instrument.DataLoader(SleepDataset(4), batch_size=2, name="t", registry=registry), 3)
    lines = [r.getMessage() for r in caplog.records if "num_workers=0 prefetch_factor" in
             r.getMessage()]
    assert len(lines) == 1
    cpu = advisor.local_cpu()
    assert f"; {cpu.describe()}, local ranks=1," in lines[0] and "/dev/shm size=" in lines[0]


def test_num_workers_zero_warns_once(registry: CollectorRegistry,
                                     caplog: pytest.LogCaptureFixture) -> None:
    run(instrument.DataLoader(SleepDataset(4), batch_size=2, name="t", registry=registry), 3)
    assert [w for w in warnings_of(caplog) if "num_workers=0" in w] == [
        warnings_of(caplog)[0]]
    assert len(warnings_of(caplog)) == 1


def test_loaders_built_again_under_one_name_are_advised_once(
        registry: CollectorRegistry, caplog: pytest.LogCaptureFixture) -> None:
    """A sweep or an evaluation loop that builds a loader per trial is told once per name,
    not once per loader; a loader of another name gets its own word."""
    caplog.set_level(logging.INFO, logger="dataloader_exporter.instrument")
    for name in ("eval", "eval", "eval", "other"):
        run(instrument.DataLoader(SleepDataset(4), batch_size=2, name=name, registry=registry))
    said = [r.getMessage() for r in caplog.records]
    for name in ("eval", "other"):
        assert sum(f"dataloader {name!r}: num_workers=0 loads" in m for m in said) == 1
        assert sum(f"dataloader {name!r}: num_workers=0 prefetch_factor" in m
                   for m in said) == 1
    assert len(warnings_of(caplog)) == 2


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_more_workers_than_usable_cores_warns(registry: CollectorRegistry,
                                              caplog: pytest.LogCaptureFixture) -> None:
    cpu = advisor.local_cpu()
    n = cpu.usable + 1
    run(instrument.DataLoader(SleepDataset(n), batch_size=1, num_workers=n, name="t",
                              registry=registry))
    assert any(f"num_workers={n} x 1 local rank exceeds the {cpu.describe()}" in w
               for w in warnings_of(caplog))


def advice_of(caplog: pytest.LogCaptureFixture, workers: int, cpu: Cpu, ranks: int) -> str:
    """The setup warning a loader with `workers` gets on `cpu` with `ranks` local ranks."""
    pre = Preflight("t", cpu=lambda: cpu, local_ranks=lambda: ranks, cuda=lambda: False)
    pre.on_iter(LoaderConfig(workers, 8, 2 if workers else None, False, True), 1)
    [warning] = warnings_of(caplog)
    return warning


# A 2-CPU container on a 16-core host, and 4 CPUs pinned by affinity on a 64-core host.
QUOTA = Cpu(physical=16, quota=2.0, affinity=32)
PINNED = Cpu(physical=64, quota=None, affinity=4)


@pytest.mark.parametrize(("cpu", "ranks", "advice"), [
    (QUOTA, 1, 1), (QUOTA, 2, 1), (QUOTA, 8, 1),
    (PINNED, 1, 3), (PINNED, 2, 1), (PINNED, 8, 1),
    (Cpu(physical=64, quota=48.0, affinity=128), 1, 47),
    (Cpu(physical=64, quota=48.0, affinity=128), 2, 23),
    (Cpu(physical=64, quota=48.0, affinity=128), 8, 5),
])
def test_setup_advice_divides_the_usable_cores_among_the_local_ranks(
        caplog: pytest.LogCaptureFixture, cpu: Cpu, ranks: int, advice: int) -> None:
    assert f"try num_workers={advice} " in advice_of(caplog, 0, cpu, ranks)
    # The doctor's advisor says the same for a starved loader on that machine.
    assert advisor.advised_workers(0, True, cpu, ranks, cuda=False) == advice


@pytest.mark.parametrize(("workers", "ranks", "warns"), [(2, 1, False), (1, 2, False),
                                                         (2, 2, True), (1, 8, True)])
def test_too_many_workers_counts_every_local_rank_against_the_quota(
        caplog: pytest.LogCaptureFixture, workers: int, ranks: int, warns: bool) -> None:
    pre = Preflight("t", cpu=lambda: QUOTA, local_ranks=lambda: ranks, cuda=lambda: False)
    pre.on_iter(LoaderConfig(workers, 8, 2, False, True), 1)
    found = [w for w in warnings_of(caplog) if "exceeds the 2 cores (cgroup quota 2, 16 "
             "physical)" in w]
    assert bool(found) == warns
    if warns:
        assert f"num_workers={workers} x {ranks} local rank" in found[0]
        # Before the workers run nothing says they are CPU-bound: no smaller count is
        # advised (workers blocked on storage may need many more than the cores).
        assert "try num_workers" not in found[0] and "not known before they run" in found[0]


def test_with_a_gpu_the_loop_keeps_no_core_of_its_own() -> None:
    assert advisor.advised_workers(0, True, PINNED, 1, cuda=True) == 4
    assert advisor.advised_workers(0, True, PINNED, 1, cuda=False) == 3


def test_non_persistent_workers_warn_from_the_second_epoch(
        registry: CollectorRegistry, caplog: pytest.LogCaptureFixture) -> None:
    loader = instrument.DataLoader(SleepDataset(2), batch_size=1, num_workers=1, name="t",
                                   registry=registry)
    run(loader)
    assert not any("persistent_workers" in w for w in warnings_of(caplog))
    run(loader, 2)
    assert len([w for w in warnings_of(caplog) if "persistent_workers=True" in w]) == 1


def test_persistent_workers_do_not_warn(registry: CollectorRegistry,
                                        caplog: pytest.LogCaptureFixture) -> None:
    run(instrument.DataLoader(SleepDataset(2), batch_size=1, num_workers=1, name="t",
                              persistent_workers=True, registry=registry), 2)
    assert warnings_of(caplog) == []


def test_pin_memory_off_warns_once_when_batches_go_to_cuda(
        caplog: pytest.LogCaptureFixture) -> None:
    # No GPU here: the CUDA branch of to_device calls exactly this hook (loader.py).
    pre = Preflight("t")
    for _ in range(3):
        pre.on_cuda_transfer(LoaderConfig(2, 8, 2, False, True))
    pre.on_cuda_transfer(LoaderConfig(2, 8, 2, True, True))
    assert len([w for w in warnings_of(caplog) if "pin_memory=True" in w]) == 1


def test_batches_that_would_overflow_shm_warn_with_the_numbers_and_the_fix(
        registry: CollectorRegistry, caplog: pytest.LogCaptureFixture) -> None:
    loader = instrument.DataLoader(SleepDataset(8, width=256 * 1024), batch_size=4,
                                   num_workers=2, persistent_workers=True, name="t",
                                   registry=registry)
    # A Docker-default 64 MiB /dev/shm, mostly full, injected (this machine's is 24 GB).
    loader._instruments.preflight = Preflight(
        "t", shm_probe=lambda p: ShmSpace(p, 64 * MiB, 48 * MiB, 16 * MiB))
    run(loader, 2)
    shm = [w for w in warnings_of(caplog) if "bus error" in w]
    assert len(shm) == 1
    # A 4 MiB batch x prefetch 2 x 2 workers x 1.5 = 24 MiB > 16 MiB free.
    batch = 4 * 256 * 1024 * 4 + 4 * 8
    need = shm_needed(batch, LoaderConfig(2, 4, 2, False, True))
    assert need == int(batch * 2 * 2 * 1.5)
    assert "4.0 MiB x prefetch_factor 2 x 2 workers x 1 local ranks x 1.5 = 24.0 MiB" in shm[0]
    assert "has only 16.0 MiB free (of 64.0 MiB)" in shm[0]
    assert "--shm-size=1g" in shm[0]


def test_batches_that_fit_in_shm_do_not_warn(registry: CollectorRegistry,
                                             caplog: pytest.LogCaptureFixture) -> None:
    loader = instrument.DataLoader(SleepDataset(8, width=1024), batch_size=4, num_workers=2,
                                   persistent_workers=True, name="t", registry=registry)
    loader._instruments.preflight = Preflight(
        "t", shm_probe=lambda p: ShmSpace(p, 64 * MiB, 4 * MiB, 60 * MiB))
    run(loader)
    assert warnings_of(caplog) == []


def test_a_short_lived_pools_first_batch_checks_shm_once_a_second_per_settings(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """/dev/shm's free space is read at a pool's first batch, again for the same settings
    and batch size once SHM_FREE_EVERY has passed, and at once for another batch size."""
    from dataloader_exporter.instrument import preflight

    probes: list[str] = []
    free = [60 * MiB]

    def probe(path: str) -> ShmSpace:
        probes.append(path)
        return ShmSpace(path, 64 * MiB, 64 * MiB - free[0], free[0])

    now = [100.0]
    monkeypatch.setattr(preflight.time, "monotonic", lambda: now[0])
    pre = Preflight("t", shm_probe=probe)
    cfg = LoaderConfig(2, 4, 2, False, False)
    pre.on_first_batch(cfg, MiB)
    pre.on_first_batch(LoaderConfig(2, 4, 2, False, False), MiB)  # the next pool, equal
    assert len(probes) == 1
    pre.on_first_batch(cfg, 2 * MiB)  # larger batches: checked now
    assert len(probes) == 2
    free[0] = 4 * MiB  # the shm fills up...
    pre.on_first_batch(cfg, 2 * MiB)
    assert len(probes) == 2 and warnings_of(caplog) == []
    now[0] += preflight.SHM_FREE_EVERY  # ...and is seen a second later
    pre.on_first_batch(cfg, 2 * MiB)
    assert len(probes) == 3
    assert len([w for w in warnings_of(caplog) if "bus error" in w]) == 1


def test_shm_size_advice_rounds_up_to_whole_gibibytes_with_headroom() -> None:
    assert shm_size_advice(10 * MiB) == "1g"
    assert shm_size_advice(1024 * MiB) == "2g"
    assert shm_size_advice(7 * 1024 * MiB) == "9g"


def test_network_storage_gets_more_workers_than_cores_but_a_few_per_core_at_most() -> None:
    assert advisor.advised_workers(0, True, PINNED, 1, cuda=True, storage="network") == 16
    assert advisor.advised_workers(0, True, QUOTA, 8, cuda=True, storage="network") == 4


@pytest.mark.parametrize(("env", "ranks"), [
    ({}, 1),
    ({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "16"}, 4),  # torchrun, many machines
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, 8),  # mpirun
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, 2),  # Lightning's own launcher
    ({"WORLD_SIZE": "16", "MASTER_ADDR": "10.0.0.7"}, 1),  # elsewhere: not known, 1
    ({"LOCAL_WORLD_SIZE": "x", "WORLD_SIZE": "0", "MASTER_ADDR": "localhost"}, 1),
])
def test_the_ranks_on_this_machine_come_from_what_the_launcher_says(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], ranks: int) -> None:
    from dataloader_exporter.instrument.rank import local_world_size

    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert local_world_size() == ranks
