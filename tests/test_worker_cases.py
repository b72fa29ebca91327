"""Why the input is slow and why a worker failed, caused for real (issue 20): workers that
spin, that fight over one core, that sleep; a dataset that raises, a worker that
segfaults, one killed from outside, a /dev/shm too small, a memory cgroup's OOM kill.
Each failing case runs torch's own DataLoader first, then ours, in the same process: the
loop sees the same exception. The doctor reads the run's snapshot files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from procs import REPO, SCRIPTS, Run, run_script

from exporter import catalogue as cat
from exporter.facts.cgroup import OomKills
from instrument.failures import OomWatch

SCRIPT = str(SCRIPTS / "worker_cases.py")


def doctor(directory: Path) -> dict[str, Any]:
    """doctor --metrics-dir over an ended run (its files aged: read whole, at once)."""
    old = time.time() - 60
    for path in directory.glob("*.prom"):
        os.utime(path, (old, old))
    out = subprocess.run([sys.executable, "-m", "dataloader_exporter", "doctor",
                          "--metrics-dir", str(directory), "--format", "json"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode in (0, 1), out.stderr
    return dict(json.loads(out.stdout))


def loader(report: dict[str, Any], name: str) -> dict[str, Any]:
    [found] = [d for d in report["loaders"] if d["loader"] == name]
    return dict(found)


def case(tmp: Path, name: str, wrap: list[str] | None = None) -> Run:
    return run_script(tmp, [*(wrap or []), sys.executable, SCRIPT, name, str(tmp)],
                      {"DATALOADER_EXPORTER_DIR": str(tmp / "m"),
                       "PYTHONPATH": os.pathsep.join([str(SCRIPTS), str(REPO)])})


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("slow")
    return case(tmp, "slow"), doctor(tmp / "m")


@pytest.mark.parametrize("name", ["cpu", "cpu_contention", "blocked"])
def test_the_doctor_names_why_the_workers_are_slow(slow: tuple[Run, dict[str, Any]],
                                                   name: str) -> None:
    _, report = slow
    workers = loader(report, name)["workers"]
    assert workers["bottleneck"] == name, workers
    shares = (workers["running_share"], workers["waiting_for_cpu_share"],
              workers["blocked_share"])
    assert abs(sum(shares) - 1) < 1e-6
    share = dict(zip(("cpu", "cpu_contention", "blocked"), shares, strict=True))[name]
    assert share > 0.5, workers  # the state the bottleneck names is most of their time
    assert workers["rss_bytes"] > 10 * 2**20  # a worker of a torch process: tens of MiB


def test_advice_follows_the_bottleneck(slow: tuple[Run, dict[str, Any]]) -> None:
    _, report = slow

    def advised(name: str) -> dict[str, str]:
        return {r["setting"]: r["value"] for r in loader(report, name)["recommendations"]}

    assert int(advised("cpu_contention").get("num_workers", 4)) < 4  # fewer: they queue
    assert int(advised("blocked")["num_workers"]) > 2  # more: they overlap their waits
    assert int(advised("cpu").get("num_workers", 1)) <= 1  # no free core on 2 cores, no GPU


def test_worker_time_is_counted_only_while_batches_flow(
        slow: tuple[Run, dict[str, Any]]) -> None:
    """Three loaders in turn, persistent workers: each loader's workers sat idle while
    the others ran, which is not "blocked". Wall time counted is about the loader's own
    turn (3 s) times its workers, not the whole run's 9 s."""
    run, _ = slow
    for name, workers in (("cpu", 1), ("cpu_contention", 4), ("blocked", 2)):
        counted = sum(v for n, lab, v in run.samples[0]
                      if n == cat.WORKER_TIME.name and lab["loader"] == name)
        assert counted < workers * 4.5, (name, counted)


def test_the_why_series_stay_within_budget_whatever_the_worker_count(
        slow: tuple[Run, dict[str, Any]]) -> None:
    """At most 15 more series per loader and rank, the same for 1 worker as for 4."""
    run, _ = slow
    new = {m.name for m in (cat.WORKER_TIME, cat.WORKER_READ, cat.WORKER_MAJOR_FAULTS,
                            cat.WORKER_MEMORY, cat.WORKER_MAX_RSS, cat.FAILURES)}
    counts = {name: sum(1 for n, lab, _ in run.samples[0] if n in new and lab["loader"] == name)
              for name in ("cpu", "cpu_contention")}
    assert counts["cpu"] == counts["cpu_contention"] <= 15, counts


@pytest.mark.parametrize(("name", "cause"), [("error", "error"), ("crash", "crash"),
                                             ("killed", "killed")])
def test_a_failure_is_told_by_its_cause_and_the_loop_sees_torchs_exception(
        tmp_path: Path, name: str, cause: str) -> None:
    run = case(tmp_path, name)
    seen = run.truth[0]["seen"]
    assert seen["ours"] == seen["bare"] != "no exception"
    assert run.value(0, cat.FAILURES.name, loader=name, cause=cause) == 1
    others = [c for c in cat.FAILURE_CAUSES if c != cause]
    assert all(run.value(0, cat.FAILURES.name, loader=name, cause=c) == 0 for c in others)
    assert run.log.count(f"dataloader '{name}'") >= 1  # one line, with its fix
    failures = loader(doctor(tmp_path / "m"), name)["failures"]
    assert [f["cause"] for f in failures] == [cause] and failures[0]["fix"]


def _root_or_skip(what: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"needs root for {what}")


def test_a_full_dev_shm_is_told_as_shm_with_the_size_to_give(tmp_path: Path) -> None:
    """A private 32 MiB /dev/shm (unshare -m, a tmpfs of its own) and batches of 16 MiB."""
    _root_or_skip("a private /dev/shm")
    small = ["unshare", "-m", "sh", "-c",
             'mount -t tmpfs -o size=32m tmpfs /dev/shm && exec "$@"', "sh"]
    run = case(tmp_path, "shm", small)
    seen = run.truth[0]["seen"]
    assert seen["ours"] == seen["bare"] != "no exception"
    assert run.value(0, cat.FAILURES.name, loader="shm", cause="shm") == 1
    assert "lack of shared memory" in run.log and "--shm-size=1g" in run.log
    # (The doctor runs outside that namespace: the /dev/shm it sees is the machine's.)
    [failure] = loader(doctor(tmp_path / "m"), "shm")["failures"]
    assert failure["cause"] == "shm" and "shm-size" in failure["fix"]


def test_an_oom_kill_is_told_as_oom_only_on_the_kernels_count(tmp_path: Path) -> None:
    """A worker that allocates past its memory cgroup's limit (cgroup v1 here)."""
    _root_or_skip("a memory cgroup")
    group = Path("/sys/fs/cgroup/memory") / f"dataloader-exporter-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(800 * 2**20))
    except OSError as e:
        pytest.skip(f"no writable cgroup v1 memory controller here ({e})")
    try:
        run = case(tmp_path, "oom", ["sh", "-c",
                                     f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh"])
        kills = OomKills(cgroup_root="/sys/fs/cgroup")  # ours, not the test's group
        assert kills.source is not None
        assert "oom_kill 2" in (group / "memory.oom_control").read_text()  # bare's, ours
    finally:
        group.rmdir()
    seen = run.truth[0]["seen"]
    assert seen["ours"] == seen["bare"] != "no exception"
    assert run.value(0, cat.FAILURES.name, loader="oom", cause="oom") == 1
    assert run.value(0, cat.FAILURES.name, loader="oom", cause="killed") == 0
    assert "killed by the kernel's OOM killer" in run.log


class Counter:
    """The kernel's count as a test sets it."""

    def __init__(self) -> None:
        self.value: int | None = 0

    def count(self) -> int | None:
        return self.value


def test_an_oom_rise_is_claimed_once_and_only_while_fresh() -> None:
    kills, now = Counter(), [0.0]
    watch = OomWatch(kills, clock=lambda: now[0])
    watch.read()
    assert not watch.claim()  # no rise: a SIGKILL from elsewhere
    kills.value = 1
    assert watch.claim() and not watch.claim()  # one kill, claimed by one death
    kills.value, now[0] = 2, 30.0  # a kill of another process, long before the next death
    watch.read()
    now[0] = 45.0
    assert not watch.claim()
    kills.value = None  # the kernel gives no count: never oom
    assert not watch.claim()


def test_cgroup_v2_and_v1_oom_counts_are_read_from_the_processes_own_cgroup(
        tmp_path: Path) -> None:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/kubepods/pod1/trainer\n")
    events = root / "kubepods" / "pod1" / "trainer" / "memory.events"
    events.parent.mkdir(parents=True)
    events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n")
    assert OomKills(str(proc), str(root)).count() == 1
    (proc / "self" / "cgroup").write_text("12:memory:/train\n0::/\n")
    control = root / "memory" / "train" / "memory.oom_control"
    control.parent.mkdir(parents=True)
    control.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 4\n")
    events.unlink()
    assert OomKills(str(proc), str(root)).count() == 4
    (proc / "vmstat").write_text("nr_free_pages 1\noom_kill 9\n")
    control.unlink()
    assert OomKills(str(proc), str(root)).count() == 9  # no cgroup counts: the machine's


def test_the_snapshot_is_written_before_the_exception_reaches_the_loop(
        tmp_path: Path) -> None:
    """No periodic write for an hour: what the file says right after the loop caught the
    exception was written on the way to it."""
    from helpers import FailingDataset, parse
    from prometheus_client import CollectorRegistry

    import instrument

    registry = CollectorRegistry()
    writer = instrument.hub_for(registry).write_snapshots(str(tmp_path), interval=3600)
    loader = instrument.DataLoader(FailingDataset(8, bad=3), batch_size=1, name="t",
                                   registry=registry)
    with pytest.raises(ValueError, match="corrupt sample 3"):
        for _ in loader:
            pass
    written = parse(Path(writer.path).read_text())
    labels = (("cause", "error"), ("loader", "t"), ("rank", "0"))
    assert written[(cat.FAILURES.name, labels)] == 1
    assert written[(cat.BATCHES.name, (("loader", "t"), ("rank", "0")))] == 3
    writer.close()
