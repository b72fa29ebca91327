"""Old snapshot files are deleted once no one needs them: a run that exited normally after
remove_after, a run that ended badly (killed, or with a lost worker) after keep_failed_for,
the newest few only; a directory that cannot be written is read all the same."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.clock import Clock
from support.helpers import small_tmpfs
from support.real_snapshots import real_snapshot
from support.snapshot_dir import T0, served, write

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.exporter.collectors.trainer import TrainerCollector
from dataloader_exporter.exporter.snapshot_retention import default_remove_after


@pytest.fixture(scope="module")
def good() -> bytes:
    """A real snapshot: loader t of rank 0 with 2 workers, 4 batches."""
    return real_snapshot("0", (("t", 2),))


@pytest.fixture(scope="module")
def exited() -> bytes:
    """good, as the last snapshot of a process that exited normally."""
    return real_snapshot("0", (("t", 2),), exited=True)


@pytest.fixture(scope="module")
def two_loaders() -> bytes:
    """A real snapshot of rank 1 with loaders t (2 workers) and v (none)."""
    return real_snapshot("1", (("t", 2), ("v", 0)))


@pytest.mark.slow
def test_a_thousand_restarts_leave_only_recent_files_in_the_directory_and_the_caches(
        tmp_path: Path, exited: bytes, clock: Clock) -> None:
    good = exited  # processes that exited normally: their files go after remove_after
    start = clock.now
    collector = TrainerCollector(str(tmp_path), stale_after=30, clock=clock)
    assert collector.remove_after == 600
    for restart in range(1000):
        # Each restart is a new process with a new file; one in a hundred is killed
        # mid-write and leaves write_to_textfile's temporary file behind.
        when = start + restart * 10
        write(tmp_path / f"host-{restart}-a1b2c3d4.prom", good, mtime=when)
        if restart % 100 == 0:
            write(tmp_path / f"host-{restart}-a1b2c3d4.prom.{restart}.1", good[:99],
                  mtime=when)
        clock.now = when
        families = list(collector.collect())
        assert len(os.listdir(tmp_path)) <= 62  # 600 s of files, 10 s apart, and one more
        assert len(collector._verdicts) <= 4  # the fresh ones: 30 s of files
    batches = [s for f in families for s in f.samples if s.name == cat.BATCHES.name]
    assert [(s.labels, s.value) for s in batches] == [({"loader": "t", "rank": "0"}, 4)]
    assert sorted(os.listdir(tmp_path)) == sorted(
        f"host-{r}-a1b2c3d4.prom" for r in range(939, 1000))  # 600 s old at most
    assert sorted(collector._verdicts) == sorted(
        str(tmp_path / f"host-{r}-a1b2c3d4.prom") for r in range(996, 1000))  # 30 s
    assert collector.errors == 0 and not collector._bad


@contextlib.contextmanager
def read_only_directory(path: Path, fill: Callable[[Path], None]) -> Iterator[Path]:
    """A directory filled, then made read-only: a read-only tmpfs for root (whom file
    modes do not stop), mode 555 for anyone else."""
    if os.geteuid() != 0:
        path.mkdir()
        fill(path)
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    with small_tmpfs(path, "8m") as mnt:
        fill(mnt)
        if subprocess.run(["mount", "-o", "remount,ro", str(mnt)],
                          capture_output=True).returncode != 0:
            pytest.skip("cannot remount read-only")
        yield mnt


def test_old_files_that_cannot_be_deleted_are_logged_once_and_never_fail_a_scrape(
        tmp_path: Path, exited: bytes, two_loaders: bytes,
        caplog: pytest.LogCaptureFixture) -> None:
    def fill(directory: Path) -> None:
        write(directory / "old.prom", exited, age=3600)
        write(directory / "current.prom", two_loaders)

    with read_only_directory(tmp_path / "metrics", fill) as directory:
        collector = TrainerCollector(str(directory))
        for _ in range(3):
            samples, _ = served(collector)
            assert samples[(cat.BATCHES.name, (("loader", "v"), ("rank", "1")))] == 4
            assert samples[(cat.COLLECTOR_UP.name, (("collector", "trainer"),))] == 1
            assert samples[(cat.SNAPSHOT_FILES.name, (("state", "stale"),))] == 1
            assert T0 not in samples
        assert (directory / "old.prom").exists()
    assert len([r for r in caplog.records if "cannot delete" in r.getMessage()]) == 1


def test_the_last_snapshot_of_a_run_that_ended_badly_is_kept_for_days_the_newest_only(
        tmp_path: Path, good: bytes, exited: bytes, clock: Clock) -> None:
    """Past remove_after, a run's last snapshot goes if its process exited normally with
    no lost worker or failure; one with no normal exit (killed) or with a lost worker is
    kept for keep_failed_for, the newest KEEP_FAILED_FILES of them (a crash loop)."""
    from dataloader_exporter.exporter.snapshot_retention import KEEP_FAILED_FILES, KEEP_FAILED_FOR

    lost = exited.replace(
        b'dataloader_workers_lost_total{loader="t",rank="0"} 0.0',
        b'dataloader_workers_lost_total{loader="t",rank="0"} 1.0')
    assert lost != exited
    start = clock.now
    collector = TrainerCollector(str(tmp_path), stale_after=30, clock=clock)
    write(tmp_path / "exited.prom", exited, mtime=start)
    write(tmp_path / "lost.prom", lost, mtime=start + 100)
    for i in range(KEEP_FAILED_FILES + 4):  # a crash loop: killed, restarted, killed
        write(tmp_path / f"killed-{i:02d}.prom", good, mtime=start + i)
    clock.now = start + 3600  # past remove_after (600 s)
    served(collector)
    served(collector)  # a second scrape reads nothing again and deletes nothing more
    kept = sorted(p.name for p in tmp_path.iterdir())
    newest = [f"killed-{i:02d}.prom" for i in range(5, KEEP_FAILED_FILES + 4)]
    assert kept == sorted(["lost.prom", *newest]), kept
    clock.now = start + KEEP_FAILED_FOR + 3600
    served(collector)
    assert not list(tmp_path.iterdir())
    assert collector.errors == 0 and not collector._failed


def test_files_are_deleted_after_ten_times_stale_after_and_never_sooner_than_ten_minutes(
        ) -> None:
    assert default_remove_after(30) == 600
    assert default_remove_after(1) == 600
    assert default_remove_after(120) == 1200
    assert TrainerCollector("unused", stale_after=60).remove_after == 600
    with pytest.raises(ValueError):
        TrainerCollector("unused", stale_after=60, remove_after=30)
