"""The trainer collector against real snapshot files on disk."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from support.clock import Clock
from support.helpers import parse, scrape
from support.torch_helpers import SleepDataset

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.exporter.collectors.supervisor import Supervisor
from dataloader_exporter.exporter.collectors.trainer import TrainerCollector
from dataloader_exporter.instrument.hub import hub_for

pytestmark = pytest.mark.torch

L = (("loader", "t"), ("rank", "0"))


def trainer_file(directory: Path, batches: int, loader: str = "t", rank: str = "0",
                 name: str | None = None, exited: bool = False) -> Path:
    """Runs a real instrumented loader for `batches` batches and writes its snapshot
    (exited: the last one of a process that exits normally)."""
    reg = CollectorRegistry()
    dl = instrument.DataLoader(SleepDataset(batches), batch_size=1, name=loader,
                               registry=reg)
    os.environ["RANK"] = rank
    try:
        for _ in dl:
            pass
    finally:
        del os.environ["RANK"]
    if exited:
        instrument.hub_for(reg).exiting()
    path = directory / (name or f"host-{loader}-{rank}-{time.monotonic_ns()}.prom")
    path.write_bytes(generate_latest(reg))
    return path


def exporter_registry(collector: TrainerCollector) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(Supervisor([collector]))
    return reg


def test_files_of_several_ranks_are_merged(tmp_path: Path) -> None:
    trainer_file(tmp_path, 3, rank="0")
    trainer_file(tmp_path, 5, rank="1")
    reg = exporter_registry(TrainerCollector(str(tmp_path)))
    assert reg.get_sample_value(cat.BATCHES.name, {"loader": "t", "rank": "0"}) == 3
    assert reg.get_sample_value(cat.BATCHES.name, {"loader": "t", "rank": "1"}) == 5
    assert reg.get_sample_value(cat.SNAPSHOT_FILES.name, {"state": "fresh"}) == 2
    assert reg.get_sample_value(cat.COLLECTOR_UP.name, {"collector": "trainer"}) == 1
    age = reg.get_sample_value(cat.SNAPSHOT_AGE.name)
    assert age is not None and 0 <= age < 5


def test_stale_files_are_dropped_without_being_read(tmp_path: Path, clock: Clock) -> None:
    old = trainer_file(tmp_path, 3, rank="0")
    os.utime(old, (clock.now - 100, clock.now - 100))
    trainer_file(tmp_path, 5, rank="1")
    old.chmod(0)  # would fail to read (for non-root) if it were read
    reg = exporter_registry(TrainerCollector(str(tmp_path), stale_after=30, clock=clock))
    assert reg.get_sample_value(cat.BATCHES.name, {"loader": "t", "rank": "0"}) is None
    assert reg.get_sample_value(cat.BATCHES.name, {"loader": "t", "rank": "1"}) == 5
    assert reg.get_sample_value(cat.SNAPSHOT_FILES.name, {"state": "stale"}) == 1
    assert reg.get_sample_value(cat.COLLECTOR_ERRORS.name, {"collector": "trainer"}) == 0


def test_a_hundred_restarts_leave_no_stale_series_and_no_double_counting(
        tmp_path: Path, clock: Clock) -> None:
    collector = TrainerCollector(str(tmp_path), stale_after=30, clock=clock)
    reg = exporter_registry(collector)
    start = clock.now
    for restart in range(100):
        # Each restart is a new process: a new file, counters from zero, and (in some
        # restarts) a different set of workers; older files linger until they go stale.
        # (Processes that exited normally: a killed one's last file is kept for days,
        # test_snapshot_files.)
        path = trainer_file(tmp_path, 1 + restart % 3, name=f"host-{restart}-x.prom",
                            exited=True)
        when = start + restart * 10
        os.utime(path, (when, when))
        clock.now = when
        assert reg.get_sample_value(cat.BATCHES.name, {"loader": "t", "rank": "0"}) == (
            1 + restart % 3)
    samples = scrape(reg)
    series = [k for k in samples if k[0] == cat.BATCHES.name]
    assert series == [(cat.BATCHES.name, L)]
    assert samples[(cat.SNAPSHOT_FILES.name, (("state", "fresh"),))] == 4  # 30 s / 10 s
    # Files not rewritten for remove_after (600 s by default) are deleted.
    assert samples[(cat.SNAPSHOT_FILES.name, (("state", "stale"),))] == 57
    assert len(list(tmp_path.iterdir())) == 61


def test_the_newest_file_wins_series_of_the_same_loader_and_rank(tmp_path: Path) -> None:
    old = trainer_file(tmp_path, 7)
    os.utime(old, (time.time() - 5, time.time() - 5))
    trainer_file(tmp_path, 2)
    reg = exporter_registry(TrainerCollector(str(tmp_path)))
    assert reg.get_sample_value(cat.BATCHES.name, {"loader": "t", "rank": "0"}) == 2
    fetch_count = reg.get_sample_value(cat.TIME.name + "_count",
                                       {"loader": "t", "rank": "0", "phase": "fetch"})
    assert fetch_count == 2


@pytest.mark.parametrize("content", [
    "dataloader_batches_total{loader=\"t\",rank=\"9\"} 5\nthis is not prometheus text\n",
    "# TYPE dataloader_batches_total counter\ndataloader_batches_total{loader=\"t\",rank=\"9\"} 5",
    "dataloader_batches_total{loader=\"t\",rank=\"9\" 5\n",
    "\xff\xfe garbage",
])
def test_torn_or_malformed_files_are_skipped_and_counted(
        tmp_path: Path, content: str, caplog: pytest.LogCaptureFixture) -> None:
    trainer_file(tmp_path, 3)
    (tmp_path / "bad.prom").write_bytes(content.encode("latin-1"))
    collector = TrainerCollector(str(tmp_path))
    reg = exporter_registry(collector)
    for _ in range(3):  # three scrapes
        samples = scrape(reg)
        assert samples[(cat.BATCHES.name, L)] == 3
        assert (cat.BATCHES.name, (("loader", "t"), ("rank", "9"))) not in samples
        assert samples[(cat.COLLECTOR_UP.name, (("collector", "trainer"),))] == 1
    assert collector.errors == 1  # once per file and reason, not once per scrape
    assert sum(collector.rejected.values()) == 1
    assert len([r for r in caplog.records if "skipping snapshot" in r.getMessage()]) == 1


def test_temporary_files_of_a_writer_mid_write_are_ignored(tmp_path: Path) -> None:
    trainer_file(tmp_path, 3)
    (tmp_path / "host-1-abc.prom.1234.5678").write_text("dataloader_batches_total 1e9\n")
    (tmp_path / "README").write_text("not metrics")
    reg = exporter_registry(TrainerCollector(str(tmp_path)))
    assert reg.get_sample_value(cat.BATCHES.name, {"loader": "t", "rank": "0"}) == 3
    assert reg.get_sample_value(cat.COLLECTOR_ERRORS.name, {"collector": "trainer"}) == 0


def test_a_file_deleted_between_listing_and_reading_is_skipped_quietly(
        tmp_path: Path) -> None:
    path = trainer_file(tmp_path, 3)
    collector = TrainerCollector(str(tmp_path))
    fresh, _ = collector._classify(list(os.scandir(tmp_path)), time.time())
    path.unlink()
    _, name, where, stamp = fresh[0]
    assert collector._verdict(name, where, stamp) is None and collector.errors == 0


def test_a_missing_directory_marks_the_collector_down_and_logs_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    collector = TrainerCollector(str(tmp_path / "nope"))
    reg = exporter_registry(collector)
    for _ in range(3):
        assert reg.get_sample_value(cat.COLLECTOR_UP.name, {"collector": "trainer"}) == 0
    assert collector.errors == 3
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    (tmp_path / "nope").mkdir()
    assert reg.get_sample_value(cat.COLLECTOR_UP.name, {"collector": "trainer"}) == 1


def test_snapshots_of_an_in_process_server_carry_only_the_trainers_metrics(
        tmp_path: Path) -> None:
    reg = CollectorRegistry()
    handle = instrument.serve(0, addr="127.0.0.1", registry=reg)  # attaches shm/host/gpu
    try:
        for _ in instrument.DataLoader(SleepDataset(2), batch_size=1, name="t", registry=reg):
            pass
        assert reg.get_sample_value(cat.SHM_SIZE.name, {"path": "/dev/shm"}) is not None
        writer = hub_for(reg).write_snapshots(str(tmp_path))
        assert writer.write()
        written = {k[0] for k in parse(Path(writer.path).read_text())}
        assert cat.BATCHES.name in written
        trainer = {s for m in cat.ALL if m.source == cat.TRAINER for s in cat.series_names(m)}
        assert written <= trainer, written - trainer
    finally:
        handle.shutdown()
    out = exporter_registry(TrainerCollector(str(tmp_path)))
    names = {k[0] for k in parse(generate_latest(out).decode())}
    assert cat.BATCHES.name in names and cat.SHM_SIZE.name not in names
