"""An idle trainer's snapshot writer: while nothing is recorded it skips the render and
only touches its file (whose mtime is its freshness to the sidecar), renders at least one
interval in refresh_every (what changes without a record: workers' liveness and memory),
and writes at the first interval after anything is recorded."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from support.helpers import deadline_poll, parse, wait_for_write
from support.torch_helpers import SleepDataset

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.instrument.hub import hub_for
from dataloader_exporter.instrument.snapshot_writer import SnapshotWriter

pytestmark = pytest.mark.torch

OLD = 1_000_000_000  # an mtime long past (2001)


class Drifting:
    """A gauge that changes without anything being recorded (like a worker's memory),
    counting the collections that read it."""

    def __init__(self) -> None:
        self.value = 1.0
        self.collections = 0

    def collect(self) -> Iterator[GaugeMetricFamily]:
        self.collections += 1
        yield GaugeMetricFamily("drifting", "A gauge that drifts.", value=self.value)


@pytest.fixture
def idle(tmp_path: Path) -> tuple[SnapshotWriter, Drifting, list[int]]:
    """A writer (not started: the test calls tick()) whose activity is token[0]."""
    drifting, token = Drifting(), [0]
    registry = CollectorRegistry()
    registry.register(drifting)  # type: ignore[arg-type]
    writer = SnapshotWriter(registry, str(tmp_path), interval=3600,
                            activity=lambda: token[0], refresh_every=3)
    return writer, drifting, token


def written(writer: SnapshotWriter) -> float:
    return parse(Path(writer.path).read_text())[("drifting", ())]


def test_an_idle_interval_touches_the_file_instead_of_rendering_it(
        idle: tuple[SnapshotWriter, Drifting, list[int]]) -> None:
    writer, drifting, _ = idle
    assert writer.tick() and drifting.collections == 1
    before = Path(writer.path).read_bytes()
    os.utime(writer.path, (OLD, OLD))
    assert writer.tick()
    assert (drifting.collections, writer.writes, writer.skips) == (1, 1, 1)
    assert os.stat(writer.path).st_mtime > OLD  # fresh to the sidecar
    assert Path(writer.path).read_bytes() == before


def test_what_changes_without_a_record_is_written_within_refresh_every_intervals(
        idle: tuple[SnapshotWriter, Drifting, list[int]]) -> None:
    writer, drifting, _ = idle
    seen = []
    for i in range(9):
        drifting.value = float(i)
        writer.tick()
        seen.append(written(writer))
    assert seen == [0.0, 0.0, 0.0, 3.0, 3.0, 3.0, 6.0, 6.0, 6.0]
    assert (writer.writes, writer.skips, drifting.collections) == (3, 6, 3)


def test_the_first_interval_after_a_record_is_written(
        idle: tuple[SnapshotWriter, Drifting, list[int]]) -> None:
    writer, drifting, token = idle
    writer.tick()
    drifting.value, token[0] = 2.0, 1
    writer.tick()
    assert written(writer) == 2.0 and writer.skips == 0


def test_a_file_gone_is_written_again_not_touched(
        idle: tuple[SnapshotWriter, Drifting, list[int]]) -> None:
    writer, _, _ = idle
    writer.tick()
    os.remove(writer.path)
    assert writer.tick()
    assert Path(writer.path).exists() and (writer.writes, writer.skips) == (2, 0)


def test_asked_for_writes_are_never_skipped(
        idle: tuple[SnapshotWriter, Drifting, list[int]]) -> None:
    writer, drifting, _ = idle
    writer.start()
    try:
        assert deadline_poll(lambda: writer.writes >= 1, 5.0)  # the first interval's
        for _ in range(3):  # ask(): nothing recorded, written all the same
            assert wait_for_write(writer)
        assert writer.skips == 0 and drifting.collections == writer.writes >= 4
    finally:
        writer.close()
    assert drifting.collections == writer.writes  # close() writes the last snapshot


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_s_activity_changes_with_what_it_records_and_not_while_it_waits(
        tmp_path: Path, registry: CollectorRegistry, workers: int) -> None:
    hub = hub_for(registry)
    loader = instrument.DataLoader(SleepDataset(4), batch_size=1, name="t",
                                   num_workers=workers, persistent_workers=workers > 0,
                                   registry=registry)
    writer = hub.write_snapshots(str(tmp_path), interval=3600)
    assert wait_for_write(writer)  # the first interval's write
    assert writer.tick() and writer.skips == 1  # nothing recorded yet
    for x, _ in loader:  # an epoch: batches, workers started and stopped
        before = hub.activity()
        loader.to_device(x, "cpu")
        assert hub.activity() != before
    assert writer.tick() and writer.skips == 1  # written: the epoch's figures
    batches = {"loader": "t", "rank": "0"}
    assert parse(Path(writer.path).read_text())[(cat.BATCHES.name, tuple(batches.items()))] == 4
    quiet = hub.activity()  # waiting between epochs
    generate_latest(registry)  # a scrape flushes the recorders, recording nothing
    assert hub.activity() == quiet
    assert writer.tick() and writer.skips == 2
