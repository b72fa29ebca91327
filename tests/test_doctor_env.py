"""`doctor --format env`: the advice as one DATALOADER_EXPORTER_SETTINGS line, which a
loader built with that environment then takes (diagnosis to fix, no code change)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from support.torch_helpers import SleepDataset

from dataloader_exporter import instrument
from dataloader_exporter.core.envnames import ENV_SETTINGS
from dataloader_exporter.core.settings import for_loader, parse
from dataloader_exporter.diagnosis.machine import Machine
from dataloader_exporter.diagnosis.report import build_report, env_line
from dataloader_exporter.diagnosis.signals import LoaderSignals

pytestmark = pytest.mark.torch


def starved(rank: str, workers: int, loader: str = "train") -> LoaderSignals:
    s = LoaderSignals(loader, rank, seconds=10, fetch_seconds=8, step_seconds=2, batches=100,
                      samples=400, batch_bytes=4096, workers_configured=workers,
                      worker_cpu_seconds=2.0 * workers)
    s.config = {"num_workers": str(workers), "prefetch_factor": "2" if workers else "",
                "persistent_workers": "false", "pin_memory": "false"}
    return s


def machine() -> Machine:
    return Machine(8, None, 64 << 30, 32 << 30, 64 << 30, "nvme", "/data")


def test_the_env_line_holds_only_loader_settings_that_change_and_parses() -> None:
    report = build_report("test", machine(), [starved("0", 0), starved("0", 2, "val")], 1)
    line, skipped = env_line(report)
    assert skipped == []
    name, _, value = line.partition("=")
    assert name == ENV_SETTINGS
    settings = parse(value)  # what the doctor prints is always a valid line
    train, val = for_loader(settings, "train"), for_loader(settings, "val")
    assert train["num_workers"] == 7 and train["persistent_workers"] is True
    assert val["num_workers"] == 7 and val["persistent_workers"] is True
    assert "shm" not in line and "non_blocking" not in line


def test_ranks_of_one_loader_share_one_line() -> None:
    report = build_report("test", machine(), [starved("0", 1), starved("1", 3)], 1)
    value = env_line(report)[0].partition("=")[2]
    assert value.count("train.num_workers=") == 1


def test_nothing_to_change_is_an_empty_line() -> None:
    healthy = LoaderSignals("train", "0", seconds=10, fetch_seconds=0.01, step_seconds=9,
                            batches=100, workers_configured=2)
    healthy.config = {"num_workers": "2", "prefetch_factor": "2",
                      "persistent_workers": "true", "pin_memory": "false"}
    report = build_report("test", Machine(3, None, 1 << 30, 1 << 30, 1 << 30, "nvme", "/"),
                          [healthy], 1)
    assert env_line(report) == (f"{ENV_SETTINGS}=", [])


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_a_loader_built_with_the_doctors_line_takes_its_settings(
        monkeypatch: pytest.MonkeyPatch, registry: CollectorRegistry) -> None:
    value = env_line(build_report("test", machine(), [starved("0", 0)], 1))[0].partition("=")[2]
    monkeypatch.setenv(ENV_SETTINGS, value)
    loader = instrument.DataLoader(SleepDataset(4), batch_size=2, name="train",
                                   registry=registry)
    assert loader.num_workers == 7 and loader.persistent_workers is True


def test_a_loader_name_the_line_cannot_carry_is_left_out_not_a_crash() -> None:
    report = build_report("test", machine(), [starved("0", 0, "train/images"),
                                              starved("0", 0)], 1)
    line, skipped = env_line(report)
    assert skipped == ["train/images"] and "train.num_workers=7" in line


def test_a_rank_told_to_shrink_its_queue_wins_over_one_told_to_deepen_it() -> None:
    deep, shallow = starved("0", 2), starved("1", 2)
    shallow.shm_size = 1 << 20  # 4 KiB batches x 2 x 7 workers x 1.5 do not fit: halve it
    shallow.batch_bytes = 1 << 18
    report = build_report("test", machine(), [deep, shallow], 1)
    advised = {d.rank: {r.setting: r.value for r in d.recommendations}
               for d in report.diagnoses}
    assert advised["0"]["prefetch_factor"] == "4" and advised["1"]["prefetch_factor"] == "1"
    assert "train.prefetch_factor=1" in env_line(report)[0]
