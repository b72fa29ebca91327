"""Where the workers' time goes in an epoch too short for two /proc readings (a short
validation epoch): each worker's own figures, from its first batch to its last
(instrument/hotpath/workerblock.py), counted when its pool ends; what they cannot say (reads,
faults, memory) stays absent. The doctor reads the same counters."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from support.torch_helpers import BurnDataset, SleepDataset

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.diagnosis import why
from dataloader_exporter.diagnosis.machine import Machine
from dataloader_exporter.diagnosis.report import build_report
from dataloader_exporter.diagnosis.signals import Scrape, Window, loaders

pytestmark = pytest.mark.torch

LR = {"loader": "short", "rank": "0"}
MACHINE = Machine(2, None, 8 << 30, 4 << 30, 1 << 30, "nvme", "/data")


def one_epoch(registry: CollectorRegistry, data: Any) -> tuple[list[torch.Tensor], str]:
    """One short epoch of 2 non-persistent workers, nothing reading the loader while it
    runs; the batches, and the exposition before it."""
    loader = instrument.DataLoader(data, batch_size=2, num_workers=2, name="short",
                                   registry=registry)
    before = generate_latest(registry).decode()
    return [i for _x, i in loader], before


def shares(registry: CollectorRegistry) -> dict[str, float]:
    got = {st: registry.get_sample_value(cat.WORKER_TIME.name, {**LR, "state": st})
           for st in cat.WORKER_STATES}
    assert None not in got.values(), got
    total = sum(v for v in got.values() if v is not None)
    return {st: (v or 0.0) / total for st, v in got.items()}


def test_workers_waiting_on_storage_in_a_short_epoch_are_seen_blocked(
        registry: CollectorRegistry) -> None:
    data = SleepDataset(32, delay=0.01)
    got, before = one_epoch(registry, data)
    assert [int(i) for b in got for i in b] == [int(i) for _x, b in
                                                torch.utils.data.DataLoader(data, batch_size=2)
                                                for i in b]
    assert shares(registry)["blocked"] > 0.5, shares(registry)
    # The workers' own figures hold no reads, faults or memory: those stay absent.
    assert registry.get_sample_value(cat.WORKER_READ.name, {**LR, "source": "storage"}) is None
    assert registry.get_sample_value(cat.WORKER_MAJOR_FAULTS.name, LR) is None
    assert registry.get_sample_value(cat.WORKER_MAX_RSS.name, LR) is None
    # The doctor, over the epoch, says why.
    first = Scrape.parse(before, at=1000.0)
    second = Scrape.parse(generate_latest(registry).decode(), at=1001.0)
    [d] = build_report("test", MACHINE, loaders(Window.between(first, second)), 1).diagnoses
    # (Sleeping workers may also wait for a CPU on a busy machine.)
    assert d.workers.bottleneck in (why.BLOCKED, why.CONTENTION), d.workers


def test_cpu_bound_workers_in_a_short_epoch_are_seen_running(
        registry: CollectorRegistry) -> None:
    one_epoch(registry, BurnDataset(32, cpu=0.01))
    got = shares(registry)  # on a busy machine they also wait for a CPU, never block long
    assert got["running"] > got["blocked"] and got["blocked"] < 0.3, got


FORKED_WORKERS_SHARE = """
import sys
import torch
from prometheus_client import CollectorRegistry
from dataloader_exporter import instrument
assert "numpy.random" not in sys.modules, "imported before the test could see it"

class WhichRandom(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return id(sys.modules["numpy.random"])  # seeded by torch's worker loop before this

loader = instrument.DataLoader(WhichRandom(), batch_size=2, num_workers=2,
                               multiprocessing_context="fork", registry=CollectorRegistry())
ids = {int(i) for batch in loader for i in batch}
print(ids == {id(sys.modules.get("numpy.random"))})
"""


def test_forked_workers_find_numpy_random_imported_by_the_trainer(tmp_path: Any) -> None:
    """torch seeds numpy.random in each worker; the trainer imports it before a pool
    starts, so a forked worker inherits it rather than importing it (each worker's start,
    every epoch of a pool that is not persistent)."""
    import subprocess
    import sys

    script = tmp_path / "which.py"
    script.write_text(FORKED_WORKERS_SHARE)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-3000:]
