"""The loader tuner never goes past its budgets, with real limits: a memory
cgroup (v1 here) with less room than one more worker, a private /dev/shm too small for the
batches one worker would keep in flight, a process pinned to one CPU, and a torchrun job
whose ranks share the cores. Each case runs support/tuner_job.py in a process of its own,
tuned through $DATALOADER_EXPORTER_SETTINGS as a user would, and, where the limit is what stops
the growth, a control run beside it that grows without the limit. Assertions are on the
settings each epoch ran with, the tuner's log lines and metrics, and exit statuses.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from support.procs import REPO

from dataloader_exporter.core import advisor, bands
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.core.envnames import ENV_SETTINGS

pytestmark = [pytest.mark.torch, pytest.mark.slow]

TESTS = REPO / "tests"
JOB = TESTS / "support" / "tuner_job.py"
AUTO = "train.num_workers=auto,train.prefetch_factor=auto"
JOB_TIMEOUT = 60  # seconds; a job takes about 5 s on 2 cores
TORCHRUN_TIMEOUT = 120  # about 10 s
MiB = 2**20
# Samples of 20 ms of CPU and a loop step of 15 ms: without workers the loop waits for
# input well over bands.MODERATE of its time, and 16 batches make epochs of about 0.6 s.
CPU_BOUND = ("--cpu", "0.02", "--step", "0.015", "--samples", "16", "--epochs", "5")
CHANGE = re.compile(r"dataloader 'train': num_workers (\d+) -> (\d+): ")


@dataclass
class Job:
    """What one rank of a finished job saw (tuner_job.py)."""

    truth: dict[str, Any]

    @property
    def workers(self) -> list[int]:
        """num_workers each epoch ran with."""
        return [e["num_workers"] for e in self.truth["epochs"]]

    @property
    def changes(self) -> list[tuple[int, int]]:
        """The tuner's num_workers changes, from its log lines."""
        return [(int(m[1]), int(m[2])) for m in map(CHANGE.match, self.truth["log"]) if m]

    def metric(self, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        return [(s["labels"], s["value"]) for s in self.truth["metrics"]
                if s["name"] == name and all(s["labels"].get(k) == v
                                             for k, v in labels.items())]

    def stable_line(self) -> str:
        [line] = [t for t in self.truth["log"] if "the tuner is stable" in t]
        return line


def _start(out: Path, *args: str, wrap: tuple[str, ...] = (),
           torchrun: bool = False) -> subprocess.Popen[str]:
    out.mkdir()
    env = {**os.environ, ENV_SETTINGS: AUTO,
           "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])}
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--standalone"] if torchrun else [sys.executable])
    return subprocess.Popen([*wrap, *launcher, str(JOB), "--out", str(out), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=out)


def _finish(proc: subprocess.Popen[str], out: Path, ranks: int = 1,
            timeout: float = JOB_TIMEOUT) -> list[Job]:
    """Each rank's truth, once the job exited 0 (killed past `timeout`)."""
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        text, _ = proc.communicate()
        pytest.fail(f"the job ran past {timeout} s: {text[-3000:]}")
    assert proc.returncode == 0, text[-4000:]  # no OOM kill, no bus error
    return [Job(json.loads((out / f"rank{r}.json").read_text())) for r in range(ranks)]


def job(out: Path, *args: str, wrap: tuple[str, ...] = ()) -> Job:
    [found] = _finish(_start(out, *args, wrap=wrap), out)
    return found


def _root_or_skip(what: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"needs root for {what}")


def assert_grew(control: Job) -> None:
    """Without the limit the same job grows from 0 to the model's count: what stops the
    other run is the limit."""
    grown = max(control.workers)
    assert control.workers[0] == 0 and grown >= 1, control.truth["epochs"]
    assert control.changes[0] == (0, control.workers[1]), control.truth["log"]
    assert control.metric(cat.TUNER_CHANGES.name, setting="num_workers", reason="starved")


def assert_stayed_without_workers(limited: Job) -> None:
    assert limited.workers == [0] * len(limited.workers), limited.truth["epochs"]
    assert limited.changes == []
    assert {n for _, n in limited.metric(cat.TUNER_CHANGES.name)} == {0.0}  # each starts at 0
    assert "at num_workers=0," in limited.stable_line()
    assert limited.metric(cat.TUNER_STABLE.name) == [
        ({"loader": "train", "rank": "0", "settings": "num_workers,prefetch_factor"}, 1.0)]


def test_a_memory_cgroup_with_less_room_than_a_worker_keeps_the_loader_without_workers(
        tmp_path: Path) -> None:
    """From 0 workers the tuner takes one worker's memory to be the main process's RSS.
    The cgroup's limit is the control run's RSS plus 64 MiB: the room left (less the 10%
    reserve) is under that RSS, yet the job itself runs in it."""
    _root_or_skip("a memory cgroup")
    control = job(tmp_path / "control", *CPU_BOUND)
    assert_grew(control)
    assert all(e["budget"]["memory_room"] > e["rss"] for e in control.truth["epochs"])
    group = Path("/sys/fs/cgroup/memory") / f"dataloader-exporter-tuner-{os.getpid()}"
    limit = max(e["rss"] for e in control.truth["epochs"]) + 64 * MiB
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit))
    except OSError as e:
        pytest.skip(f"no writable cgroup v1 memory controller here ({e})")
    try:
        limited = job(tmp_path / "limited", *CPU_BOUND, wrap=(
            "sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh"))
        oom = (group / "memory.oom_control").read_text()
    finally:
        group.rmdir()
    assert "oom_kill 0" in oom.splitlines(), oom
    # The case is the one meant: the tuner read the cgroup's room, under the RSS.
    assert all(e["budget"]["memory_room"] < e["rss"] for e in limited.truth["epochs"])
    assert_stayed_without_workers(limited)


def test_a_dev_shm_too_small_for_the_batches_in_flight_keeps_the_loader_without_workers(
        tmp_path: Path) -> None:
    """Batches of 12 MiB: one worker with prefetch_factor 2 keeps 24 MiB in flight, 36 MiB
    with the safety margin, over a private 32 MiB /dev/shm (unshare -m, a tmpfs of its
    own). The control run, with the machine's /dev/shm, runs beside it."""
    _root_or_skip("a private /dev/shm")
    batch = 12 * MiB
    args = (*CPU_BOUND, "--sample-bytes", str(batch))
    small = ("unshare", "-m", "sh", "-c",
             'mount -t tmpfs -o size=32m tmpfs /dev/shm && exec "$@"', "sh")
    procs = {"control": _start(tmp_path / "control", *args),
             "limited": _start(tmp_path / "limited", *args, wrap=small)}
    try:
        [control], [limited] = (_finish(p, tmp_path / name) for name, p in procs.items())
    finally:
        for proc in procs.values():  # the other one, when one failed
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert_grew(control)
    need = 1 * 2 * batch * bands.SHM_SAFETY
    assert all(e["budget"]["shm_room"] >= need for e in control.truth["epochs"])
    assert all(e["budget"]["shm_room"] < need for e in limited.truth["epochs"])
    assert_stayed_without_workers(limited)


def test_a_loader_started_above_its_pinned_cores_shrinks_to_them_and_stays_within(
        tmp_path: Path) -> None:
    """The job pins itself to one CPU (its workers inherit it) and starts at 3 workers.
    A cut to the cores is a trial, kept unless the next epoch is over 5% slower: here the
    samples burn CPU and each worker spends 0.25 s of CPU at its start, so on one CPU
    fewer workers are faster by far more than the machine's noise (1.2-2x measured),
    and the cut stays."""
    cores = advisor.worker_cores(replace(advisor.local_cpu(), affinity=1), 1, False)
    pinned = job(tmp_path / "pinned", "--pin", "--workers", "3", "--cpu", "0.02",
                 "--worker-setup", "0.25", "--step", "0.005", "--samples", "16",
                 "--epochs", "5")
    assert all(e["budget"]["cores"] == cores for e in pinned.truth["epochs"])
    assert pinned.workers[0] == 3
    assert max(pinned.workers[1:]) <= cores, pinned.truth["epochs"]
    assert pinned.changes[0] == (3, cores), pinned.truth["log"]
    assert all(new <= cores for _, new in pinned.changes), pinned.truth["log"]
    # One cut, counted under its reason: more workers than the cores or, where the
    # machine is busy enough that the workers' figures fall short of CPU-bound (seen here
    # beside a busy loop), workers waiting for a CPU; both cut to the cores.
    counted = pinned.metric(cat.TUNER_CHANGES.name, setting="num_workers")
    cuts = [(labels["reason"], n) for labels, n in counted if n]
    assert cuts in ([("cores", 1)], [("cpu-contention", 1)]), (counted, pinned.truth["log"])


def test_each_torchrun_rank_stays_within_its_share_of_the_cores_and_reports_its_own_changes(
        tmp_path: Path) -> None:
    """Two ranks on this machine (torchrun, gloo on CPU, an all-reduce each step), each
    with its own loader tuned from 0 workers: each reads its share of the cores through
    $LOCAL_WORLD_SIZE and never goes past it; each logs and counts its own changes under
    its own rank."""
    share = advisor.worker_cores(advisor.local_cpu(), 2, False)
    out = tmp_path / "ddp"
    ranks = _finish(_start(out, "--ddp", *CPU_BOUND, "--samples", "32", torchrun=True),
                    out, ranks=2, timeout=TORCHRUN_TIMEOUT)
    for rank, seen in enumerate(ranks):
        assert seen.truth["rank"] == rank
        assert all(e["budget"]["cores"] == share for e in seen.truth["epochs"])
        assert seen.workers[0] == 0 and max(seen.workers) <= share, (rank, seen.truth["log"])
        assert seen.changes and all(new <= share for _, new in seen.changes), seen.truth["log"]
        # Its changes are counted under its own rank, as many as it logged.
        counted = seen.metric(cat.TUNER_CHANGES.name, setting="num_workers")
        assert {labels["rank"] for labels, _ in counted} == {str(rank)}
        assert sum(n for _, n in counted) == len(seen.changes)
        [(labels, _)] = seen.metric(cat.TUNER_STABLE.name)
        assert labels == {"loader": "train", "rank": str(rank),
                          "settings": "num_workers,prefetch_factor"}
