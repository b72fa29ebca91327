"""dataloader_loop_cpu_seconds_total on real loaders: the CPU time of the thread that
iterates a loader without workers, over the stretches in which it handed out batches,
which the doctor's model reads (diagnosis/why.py, loop_load); absent where it was not
measured."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from support.torch_helpers import BurnDataset, SleepDataset

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat

pytestmark = pytest.mark.torch

_clock = itertools.count(1000, 2)  # readings past the one-second interval


def loop(loader: Any, every: int = 4) -> tuple[float, float]:
    """One epoch, the loader's figures read every `every` batches; the thread's CPU
    seconds and the wall seconds from the first reading to the last."""
    rec = loader._instruments.rec
    cpu0 = wall0 = 0.0
    for n, _ in enumerate(loader):
        if n == 0:
            cpu0, wall0 = time.thread_time(), time.perf_counter()
        if n % every == 0:
            rec.flush(now=float(next(_clock)))
    rec.flush(now=float(next(_clock)))
    return time.thread_time() - cpu0, time.perf_counter() - wall0


def loop_cpu(registry: CollectorRegistry, name: str) -> float | None:
    return registry.get_sample_value(cat.LOOP_CPU.name, {"loader": name, "rank": "0"})


def test_a_cpu_bound_loader_without_workers_shows_its_fetches_cpu_time(
        registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(BurnDataset(48, cpu=0.004), batch_size=2, name="burn",
                                   registry=registry)
    assert loop_cpu(registry, "burn") is None  # not read yet: absent, not 0
    thread_cpu, _ = loop(loader)
    got = loop_cpu(registry, "burn")
    assert got is not None
    # The fetches burn 8 ms a batch, 23 batches after the first reading: most of it is
    # counted, and never more than the thread used.
    assert 0.5 * 23 * 0.008 <= got <= thread_cpu + 0.02, (got, thread_cpu)


def test_a_loader_waiting_on_storage_shows_little_cpu_for_its_wall_time(
        registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(SleepDataset(48, delay=0.004), batch_size=2, name="sleep",
                                   registry=registry)
    _, wall = loop(loader)
    got = loop_cpu(registry, "sleep")
    assert got is not None and got < 0.5 * wall, (got, wall)


def test_a_loader_with_workers_has_no_loop_cpu_series(registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(SleepDataset(16), batch_size=2, name="pool", num_workers=2,
                                   registry=registry)
    loop(loader, every=1)
    assert loop_cpu(registry, "pool") is None
    assert registry.get_sample_value(cat.BATCHES.name, {"loader": "pool", "rank": "0"}) == 8
