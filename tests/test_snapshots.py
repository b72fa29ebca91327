"""Snapshot files: atomic, parseable, final at exit, and never a reason to stop training."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from support.helpers import deadline_poll, parse, scrape, small_tmpfs, wait_for_write
from support.torch_helpers import SleepDataset

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.instrument.hub import hub_for

pytestmark = pytest.mark.torch

REPO = Path(__file__).resolve().parents[1]
L = (("loader", "t"), ("rank", "0"))


def prom_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.prom"))


def test_snapshot_files_parse_and_match_the_registry(tmp_path: Path,
                                                     registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(SleepDataset(8), batch_size=2, num_workers=2, name="t",
                                   metrics_dir=str(tmp_path), registry=registry)
    for _ in loader:
        pass
    writer = hub_for(registry).write_snapshots(str(tmp_path))
    assert wait_for_write(writer)
    files = prom_files(tmp_path)
    assert len(files) == 1 and files[0] == Path(writer.path)
    written = parse(files[0].read_text())
    assert written[(cat.BATCHES.name, L)] == 4
    assert written[(cat.SAMPLES.name, L)] == 8
    assert written == scrape(registry) | {
        k: v for k, v in written.items() if k[0] == cat.LAST_BATCH.name}
    assert not [p for p in tmp_path.iterdir() if not p.name.endswith(".prom")]


@pytest.mark.slow
def test_the_end_of_an_epoch_triggers_a_prompt_write(tmp_path: Path,
                                                     registry: CollectorRegistry) -> None:
    writer = hub_for(registry).write_snapshots(str(tmp_path), interval=3600)
    loader = instrument.DataLoader(SleepDataset(6), batch_size=2, name="t",
                                   metrics_dir=str(tmp_path), registry=registry)
    for _ in loader:
        pass

    def batches_in_file() -> float | None:
        try:
            return parse(Path(writer.path).read_text()).get((cat.BATCHES.name, L))
        except FileNotFoundError:
            return None

    assert deadline_poll(lambda: batches_in_file() == 3, 5.0)


@pytest.mark.slow
def test_a_short_run_writes_its_last_snapshot_at_exit(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO / 'tests')!r})
        from dataloader_exporter import instrument
        from support.torch_helpers import SleepDataset
        loader = instrument.DataLoader(SleepDataset(10), batch_size=3, name="t")
        it = iter(loader)
        next(it); next(it)
    """)
    env = {**os.environ, "DATALOADER_EXPORTER_DIR": str(tmp_path / "metrics")}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=60)
    files = prom_files(tmp_path / "metrics")
    assert len(files) == 1
    assert parse(files[0].read_text())[(cat.BATCHES.name, L)] == 2


def test_promtool_accepts_the_exposition(registry: CollectorRegistry, promtool: str) -> None:
    loader = instrument.DataLoader(SleepDataset(8), batch_size=2, num_workers=2, name="t",
                                   registry=registry)
    for x, _ in loader:
        loader.to_device(x, "meta")
    text = generate_latest(registry)
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                            timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_unwritable_directory_is_logged_once_and_training_goes_on(
        tmp_path: Path, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    loader = instrument.DataLoader(SleepDataset(6), batch_size=2, name="t",
                                   metrics_dir=str(blocker / "metrics"), registry=registry)
    writer = hub_for(registry).write_snapshots(str(blocker / "metrics"))
    for _ in range(3):
        assert len(list(loader)) == 3
        assert not writer.write()
    assert writer.failures >= 3
    logged = [r for r in caplog.records if "cannot write metrics snapshot" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.WARNING


def test_a_full_disk_is_survived_and_writing_resumes_when_space_returns(
        tmp_path: Path, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture) -> None:
    with small_tmpfs(tmp_path / "tiny", "256k") as mnt:
        filler = mnt / "filler"
        with contextlib.suppress(OSError):  # more than the 256 KiB filesystem holds
            filler.write_bytes(b"x" * 512 * 1024)
        loader = instrument.DataLoader(SleepDataset(6), batch_size=2, name="t",
                                       registry=registry)
        writer = hub_for(registry).write_snapshots(str(mnt), interval=3600)
        assert len(list(loader)) == 3
        assert not writer.write()
        # The writer's own thread (woken at the end of the epoch) may be mid-write: its
        # temporary file must go too, once that write fails.
        assert deadline_poll(lambda: not list(mnt.glob("*.prom.*")), 10), (
            "a failed write leaves no temporary file")
        filler.unlink()
        assert writer.write()
        assert parse(Path(writer.path).read_text())[(cat.BATCHES.name, L)] == 3
        assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1


class _Held:
    """A collector whose collection waits until the test lets it go."""

    def __init__(self) -> None:
        import threading

        self.inside = threading.Event()
        self.go = threading.Event()

    def collect(self) -> list[object]:
        self.inside.set()
        self.go.wait(10)
        return []


@pytest.mark.slow
def test_a_write_asked_for_while_one_is_under_way_is_not_lost(tmp_path: Path) -> None:
    """The end of an epoch asks for a write while the snapshot thread is writing: the write
    under way began before the ask, so one more must follow."""
    from dataloader_exporter.instrument.snapshot_writer import SnapshotWriter

    held = _Held()
    registry = CollectorRegistry()
    registry.register(held)  # type: ignore[arg-type]
    writer = SnapshotWriter(registry, str(tmp_path), interval=3600)
    writer.start()
    try:
        assert held.inside.wait(10)  # the first write is under way
        writer.wake()
        held.go.set()
        assert deadline_poll(lambda: writer.writes >= 2, 5.0), writer.writes
    finally:
        held.go.set()
        writer.close()
