"""Copy-on-read in a real run (support/cow_job.py): 3,000,000 paths held as a Python list
by a dataset read by 2 forked persistent workers, beside the same paths in one numpy
array, both scraped by a real Prometheus. Before the list's workers reach their memory
cgroup's limit, the doctor (from the snapshot files and from Prometheus) names the growth,
copy-on-read and `dataset.paths` with the time left, and the alert's expression fires;
the numpy run gets none of it. Then the kernel's OOM killer takes a worker, and the
failure is told as oom with the growth and the attribute. (Without a writable cgroup v1
memory controller, as root, the list runs without a limit and the kill is skipped.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support.procs import REPO, Prometheus, free_port

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.dashboards.alerts import ALERTS

pytestmark = [pytest.mark.torch, pytest.mark.slow]

TESTS = REPO / "tests"
JOB = TESTS / "support" / "cow_job.py"
ROOM = 320 << 20  # what the list's cgroup may take beyond the dataset: reached in ~90 s
DEADLINE = 240.0  # seconds for the whole run: a kill comes far sooner
[GROWTH_ALERT] = [a for a in ALERTS if a.name == "DataLoaderWorkerMemoryGrowth"]


@dataclass
class Job:
    kind: str
    out: Path
    port: int
    proc: subprocess.Popen[bytes]
    group: Path | None = None
    seen: dict[str, Any] = field(default_factory=dict)  # what was read, by when

    def metrics(self) -> str:
        files = sorted((self.out / "m").glob("*.prom"))
        return "".join(f.read_text() for f in files)

    def growth(self) -> bool:
        return cat.WORKER_PRIVATE_GROWTH.name + "{" in self.metrics()


def start(tmp: Path, kind: str, group: Path | None) -> Job:
    out = tmp / kind
    out.mkdir()
    port = free_port()
    wrap = ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh"] if group else []
    with open(out / "stdout.txt", "wb") as log:  # the child holds its own copy
        proc = subprocess.Popen(
            [*wrap, sys.executable, str(JOB), "--kind", kind, "--out", str(out), "--port",
             str(port)], env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])},
            stdout=log, stderr=subprocess.STDOUT)
    return Job(kind, out, port, proc, group)


def memory_group(tmp: Path) -> Path | None:
    """A fresh cgroup v1 memory directory, or None where there is none to write."""
    if os.geteuid() != 0:
        return None
    group = Path("/sys/fs/cgroup/memory") / f"dataloader-exporter-cow-{os.getpid()}"
    try:
        group.mkdir()
    except OSError:
        return None
    return group


def doctor(*argv: str) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-m", "dataloader_exporter", "doctor", *argv,
                             "--format", "json"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode in (0, 1), result.stderr
    return dict(json.loads(result.stdout))


def cow(report: dict[str, Any]) -> dict[str, Any]:
    [found] = [d for d in report["loaders"] if d["loader"] == "cow"]
    return dict(found)


def findings(report: dict[str, Any], kind: str) -> list[str]:
    return [f["message"] for f in cow(report)["findings"] if f["kind"] == kind]


def firing(prometheus: Prometheus, job: Job) -> bool:
    return any(r["metric"].get("test") == f"cow-{job.kind}"
               for r in prometheus.query(GROWTH_ALERT.expr))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, prometheus: Prometheus
         ) -> dict[str, Job]:
    tmp = tmp_path_factory.mktemp("cow")
    group = memory_group(tmp)
    jobs = {"list": start(tmp, "list", group), "numpy": start(tmp, "numpy", None)}
    try:
        _run(jobs, prometheus)
    finally:
        for job in jobs.values():
            (job.out / "stop").touch()
            prometheus.remove_target(f"cow-{job.kind}")
        for job in jobs.values():
            try:
                job.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                job.proc.kill()
                job.proc.wait()
        if group is not None:
            group.rmdir()
    return jobs


def _run(jobs: dict[str, Job], prometheus: Prometheus) -> None:
    end = time.monotonic() + DEADLINE
    for job in jobs.values():
        while not (job.out / "ready").exists():
            assert job.proc.poll() is None, (job.out / "stdout.txt").read_text()
            assert time.monotonic() < end
            time.sleep(0.1)
        if job.group is not None:  # room beyond what the dataset already takes
            usage = int((job.out / "ready").read_text())
            (job.group / "memory.limit_in_bytes").write_text(str(usage + ROOM))
        prometheus.add_target(f"cow-{job.kind}", f"127.0.0.1:{job.port}")
        (job.out / "go").touch()
    started = time.monotonic()
    listed, numpy = jobs["list"], jobs["numpy"]
    while time.monotonic() < end and listed.proc.poll() is None:
        now = time.monotonic() - started
        for job in jobs.values():
            if "alert" not in job.seen and firing(prometheus, job):
                job.seen["alert"] = now
        if "doctor" not in listed.seen and listed.growth():
            listed.seen["doctor"] = doctor("--metrics-dir", str(listed.out / "m"),
                                           "--interval", "1")
            listed.seen["prometheus"] = doctor("--prometheus", prometheus.url, "--match",
                                               'test="cow-list"', "--range", "300")
            listed.seen["read_at"] = time.monotonic() - started
        if listed.group is None and "alert" in listed.seen and "doctor" in listed.seen:
            break  # no limit to reach
        time.sleep(0.5)
    listed.seen["ended_at"] = time.monotonic() - started
    while not numpy.growth() and time.monotonic() < end:  # measured, as long as the list
        time.sleep(0.5)
    numpy.seen["doctor"] = doctor("--metrics-dir", str(numpy.out / "m"), "--interval", "1")
    numpy.seen["prometheus"] = doctor("--prometheus", prometheus.url, "--match",
                                      'test="cow-numpy"', "--range", "300")
    numpy.seen["alert"] = numpy.seen.get("alert") or firing(prometheus, numpy)


def test_the_doctor_names_the_growth_copy_on_read_and_the_attribute(
        runs: dict[str, Job]) -> None:
    listed = runs["list"]
    for source in ("doctor", "prometheus"):
        assert source in listed.seen, f"no growth measured before the run ended: {listed.seen}"
        [message] = findings(listed.seen[source], "memory-growth")
        assert "copy-on-read" in message and "`dataset.paths` is a list of 3,000,000 str" \
            in message, message
        assert "at this rate the workers use up" in message, message  # the time left


def test_the_alert_fires_for_the_list_only(runs: dict[str, Job]) -> None:
    assert "alert" in runs["list"].seen, runs["list"].seen
    assert runs["numpy"].seen["alert"] is False


def test_the_same_paths_in_one_array_give_no_growth_and_nothing_to_name(
        runs: dict[str, Job]) -> None:
    numpy = runs["numpy"]
    for source in ("doctor", "prometheus"):
        report = numpy.seen[source]
        assert findings(report, "memory-growth") == [], report
        assert cow(report)["figures"]["worker_private_growth_bytes_per_second"] is not None
    assert cat.DATASET_OBJECTS.name + "{" not in numpy.metrics()


def test_the_kill_comes_after_the_warning_and_is_told_as_oom_with_the_growth(
        runs: dict[str, Job]) -> None:
    listed = runs["list"]
    if listed.group is None:
        pytest.skip("needs root and a writable cgroup v1 memory controller")
    assert listed.proc.returncode not in (None, 0), "the list's workers were not killed"
    warned = max(listed.seen["alert"], listed.seen["read_at"])
    assert warned < listed.seen["ended_at"]  # the alert and the doctor, then the kill
    log = (listed.out / "log.txt").read_text()
    assert "killed by the kernel's OOM killer" in log, (log, listed.seen, listed.proc.returncode,
                                                        (listed.out / "stdout.txt").read_text())
    assert "its private memory had grown from" in log and "dataset.paths" in log, log
    ended = doctor("--metrics-dir", str(listed.out / "m"))
    [oom] = [f for f in cow(ended)["failures"] if f["cause"] == "oom"]
    assert "grew" in oom["seen"] and "dataset.paths" in oom["seen"], oom
