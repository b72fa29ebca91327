"""A real torchrun job (gloo on CPU, 2 ranks, one worker each), once with rank 1 as the
input straggler and once balanced, scraped by the sidecar and a real Prometheus that
evaluates the committed recording rules. Each job measures its own truth (seconds blocked
in next(), wall time); the doctor, the recording rules and the straggler alert must agree
with it and with each other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.procs import REPO, Exporter, Prometheus, free_port

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.dashboards import recording
from dataloader_exporter.dashboards.alerts import ALERTS

pytestmark = [pytest.mark.torch, pytest.mark.slow]

TARGET = "ddp"
SLOW, EVEN = "ddp-slow", "ddp-even"
JOB_TIMEOUT = 150  # seconds; each job takes 10-20 s on 2 cores


@dataclass
class Run:
    loader: str
    truth: dict[str, dict[str, Any]]  # rank -> what the job measured itself

    @property
    def stall(self) -> float:
        """The job's input stall as the job measured it: the worst rank's share of wall
        time blocked in next() (every other rank loses the same, inside its step)."""
        return max(t["blocked"] / t["wall"] for t in self.truth.values())

    def doctor(self, prometheus: Prometheus, *extra: str) -> dict[str, Any]:
        result = subprocess.run(
            [sys.executable, "-m", "dataloader_exporter", "doctor", "--prometheus",
             prometheus.url, "--range", "600", "--match", f'test="{TARGET}",loader="{self.loader}"',
             "--format", "json", *extra], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert result.returncode in (0, 1), result.stderr
        return dict(json.loads(result.stdout))


def torchrun(out: Path, metrics: Path, loader: str, *args: str) -> Run:
    out.mkdir()
    env = {**os.environ, "DATALOADER_EXPORTER_DIR": str(metrics),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(REPO / "tests" / "support" / "ddp_job.py"), "--loader", loader, "--out", str(out),
         *args],
        capture_output=True, text=True, timeout=JOB_TIMEOUT, env=env, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    truth = {}
    for f in sorted(out.glob("rank*.json")):
        t = json.loads(f.read_text())
        truth[t["rank"]] = t
    assert sorted(truth) == ["0", "1"]
    return Run(loader, truth)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, prometheus: Prometheus
         ) -> Iterator[dict[str, Run]]:
    tmp = tmp_path_factory.mktemp("ddp")
    metrics = tmp / "metrics"
    metrics.mkdir()
    exporter = Exporter(f"--metrics-dir={metrics}", "--no-collector.gpu")
    prometheus.add_target(TARGET, exporter.address)
    try:
        prometheus.wait_for(f'up{{test="{TARGET}"}} == 1', timeout=30)
        out = {SLOW: torchrun(tmp / "slow", metrics, SLOW, "--slow-rank", "1"),
               EVEN: torchrun(tmp / "even", metrics, EVEN, "--samples", "800",
                              "--port", str(free_port()))}
        for run in out.values():  # Prometheus has the final counts and the rules ran on them
            batches = sum(t["batches"] for t in run.truth.values())
            prometheus.wait_for(
                f'sum({cat.BATCHES.name}{{test="{TARGET}",loader="{run.loader}"}}) == {batches}',
                timeout=30)
            prometheus.wait_for(f'{recording.INPUT_STALL}{{loader="{run.loader}"}}', timeout=30)
        yield out
    finally:
        prometheus.remove_target(TARGET)
        exporter.stop()


def test_the_job_level_stall_is_what_the_job_measured(runs: dict[str, Run],
                                                      prometheus: Prometheus) -> None:
    for run in runs.values():
        [job] = run.doctor(prometheus)["jobs"]
        assert job["loader"] == run.loader and job["ranks"] == 2
        assert abs(job["input_stall_share"] - run.stall) < 0.05, (run.loader, job, run.truth)
    slow = runs[SLOW]
    # The mean over ranks, the old headline, is far off: that is what this fixes.
    mean = sum(t["blocked"] / t["wall"] for t in slow.truth.values()) / 2
    assert slow.stall - mean > 0.1


def test_the_slow_rank_is_named_and_the_balanced_job_has_no_straggler(
        runs: dict[str, Run], prometheus: Prometheus) -> None:
    report = runs[SLOW].doctor(prometheus)
    assert report["jobs"][0]["stragglers"] == ["1"]
    ranks = {d["rank"]: d for d in report["loaders"]}
    assert [f["kind"] for f in ranks["0"]["findings"]] == ["waits-for-straggler"]
    assert ranks["0"]["recommendations"] == []  # it only waits: no advice for its loader
    assert "input-straggler" in [f["kind"] for f in ranks["1"]["findings"]]
    # The straggler's settings were known and it gets the advice (not silence for lack
    # of data: every figure came through Prometheus).
    assert ranks["1"]["recommendations"]
    assert not [u for u in ranks["1"]["unknowns"] if "settings are unknown" in u]
    assert ranks["1"]["figures"]["workers_configured"] == 1
    wait = ranks["0"]["figures"]["waiting_for_other_ranks_seconds_per_batch"]
    truth = runs[SLOW].truth
    blocked_gap = (truth["1"]["blocked"] - truth["0"]["blocked"]) / truth["1"]["batches"]
    assert wait == pytest.approx(blocked_gap, rel=0.3)  # the estimate: what rank 0 waited
    assert runs[EVEN].doctor(prometheus)["jobs"][0]["stragglers"] == []


def test_the_recording_rules_and_the_straggler_alert_agree_with_the_doctor(
        runs: dict[str, Run], prometheus: Prometheus) -> None:
    [alert] = [a for a in ALERTS if a.name == "DataLoaderInputStraggler"]
    for run in runs.values():
        [job] = run.doctor(prometheus)["jobs"]
        [recorded] = prometheus.query(f'{recording.INPUT_STALL}{{loader="{run.loader}"}}')
        assert float(recorded["value"][1]) == pytest.approx(job["input_stall_share"], abs=0.02)
        firing = prometheus.query(f'({alert.expr}) and on (loader) '
                                  f'{cat.BATCHES.name}{{loader="{run.loader}"}}')
        assert sorted(r["metric"]["rank"] for r in firing) == job["stragglers"]
        recorded_stragglers = prometheus.query(
            f'{recording.STRAGGLER}{{loader="{run.loader}"}} >= 0.05')
        assert sorted(r["metric"]["rank"] for r in recorded_stragglers) == job["stragglers"]


def test_the_doctor_divides_by_the_span_of_a_run_younger_than_its_range(
        runs: dict[str, Run], prometheus: Prometheus) -> None:
    run = runs[SLOW]
    report = run.doctor(prometheus)
    for d in report["loaders"]:
        t = run.truth[d["rank"]]
        true_rate = t["batches"] / t["wall"]  # --range is 600 s; the job ran 10-20 s
        assert d["figures"]["batches_per_second"] == pytest.approx(true_rate, rel=0.25)
        assert d["figures"]["local_ranks"] == 2  # both ranks report through one exporter


def test_every_local_rank_serves_its_own_port_under_torchrun(runs: dict[str, Run]) -> None:
    for rank, t in runs[EVEN].truth.items():
        assert t["local_world_size"] == "2"
        # port= is a base: local rank r serves on base + r, and each serves its own rank.
        assert t["served"] == {"0": ["0"], "1": ["1"]}, (rank, t)
