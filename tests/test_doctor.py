"""The doctor on live metrics: a real loader serving in-process, the real CLI scraping it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from support.helpers import small_tmpfs
from support.procs import REPO, Prometheus
from support.torch_helpers import SleepDataset

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.core.envnames import ENV_SETTINGS
from dataloader_exporter.core.facts.storage import storage_kind
from dataloader_exporter.diagnosis.doctor import diagnose
from dataloader_exporter.diagnosis.machine import Machine
from dataloader_exporter.diagnosis.signals import LoaderSignals, quantile

pytestmark = pytest.mark.torch

INTERVAL = 1.5
TOP_KEYS = {"healthy", "machine", "jobs", "loaders", "source", "whole_run"}
JOB_KEYS = {"loader", "ranks", "input_stall_share", "stragglers"}
LOADER_KEYS = {"loader", "rank", "verdict", "figures", "findings", "recommendations", "healthy",
               "unknowns", "workers", "failures", "tuner"}


def doctor(url: str, train: Callable[[], None], *extra: str) -> tuple[int, dict[str, Any]]:
    """Starts `doctor --format json` and trains in this (main) thread meanwhile."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dataloader_exporter", "doctor", "--url", url,
         "--interval", str(INTERVAL), "--format", "json", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    train()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode in (0, 1), err
    report = json.loads(out)
    assert set(report) == TOP_KEYS
    for loader in report["loaders"]:
        assert set(loader) == LOADER_KEYS
    for job in report["jobs"]:
        assert set(job) >= JOB_KEYS
    return proc.returncode, report


@pytest.fixture
def served() -> Iterator[tuple[CollectorRegistry, str]]:
    reg = CollectorRegistry()
    handle = instrument.serve(0, addr="127.0.0.1", registry=reg)
    yield reg, handle.url + "/metrics"
    handle.shutdown()


def train_for(loader: Any, seconds: float, step: float = 0.0) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in loader:
            if step:
                time.sleep(step)
            if time.monotonic() > end:
                break


def only(report: dict[str, Any], name: str) -> dict[str, Any]:
    [found] = [lo for lo in report["loaders"] if lo["loader"] == name]
    return found


@pytest.mark.slow
def test_a_starved_loader_is_input_bound_and_gets_workers(
        served: tuple[CollectorRegistry, str]) -> None:
    reg, url = served
    loader = instrument.DataLoader(SleepDataset(64, 0.004), batch_size=2, name="starved",
                                   registry=reg)
    code, report = doctor(url, lambda: train_for(loader, INTERVAL + 2.0))
    d = only(report, "starved")
    assert code == 1 and not report["healthy"]
    assert d["verdict"] == "input-bound" and d["figures"]["stall_share"] > 0.9
    settings = {r["setting"]: r for r in d["recommendations"]}
    assert settings["num_workers"]["current"] == "0"
    # Its samples wait on sleep, not a CPU: the tuner's model, from the loop thread's CPU
    # time, asks for workers past the core their CPU needs.
    assert int(settings["num_workers"]["value"]) >= 2, settings
    assert "waits for data" in settings["num_workers"]["why"]
    assert "the tuner's model gives" in settings["num_workers"]["why"]


@pytest.mark.slow
def test_a_healthy_loader_exits_zero(served: tuple[CollectorRegistry, str]) -> None:
    # Cheap samples made in the loop itself and a 50 ms step: the wait stays far under the
    # 5% band even on a loaded machine (worker hand-overs there can take milliseconds).
    reg, url = served
    loader = instrument.DataLoader(SleepDataset(400), batch_size=4, name="healthy",
                                   registry=reg)
    code, report = doctor(url, lambda: train_for(loader, INTERVAL + 2.0, step=0.05))
    d = only(report, "healthy")
    assert d["verdict"] == "not input-bound", d
    assert d["findings"] == [] and d["healthy"] and report["healthy"]
    assert code == 0


def _slow_start(worker_id: int) -> None:
    time.sleep(0.7)


@pytest.mark.slow
def test_non_persistent_workers_with_a_slow_start_show_an_epoch_start_stall(
        served: tuple[CollectorRegistry, str]) -> None:
    reg, url = served
    loader = instrument.DataLoader(SleepDataset(8), batch_size=2, num_workers=2,
                                   worker_init_fn=_slow_start, name="stall", registry=reg)
    code, report = doctor(url, lambda: train_for(loader, INTERVAL + 2.5))
    d = only(report, "stall")
    kinds = [f["kind"] for f in d["findings"]]
    assert "epoch-start-stall" in kinds and code == 1
    persistent = [r for r in d["recommendations"] if r["setting"] == "persistent_workers"]
    assert persistent and persistent[0]["value"] == "True"


@pytest.mark.slow
def test_batches_too_big_for_shm_are_a_risk_with_a_shm_size(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "shm", "8m") as mnt:
        reg = CollectorRegistry()
        handle = instrument.serve(0, addr="127.0.0.1", registry=reg, shm_path=str(mnt))
        try:
            loader = instrument.DataLoader(SleepDataset(32, width=256 * 1024), batch_size=4,
                                           num_workers=2, persistent_workers=True,
                                           name="big", registry=reg)
            code, report = doctor(handle.url + "/metrics",
                                  lambda: train_for(loader, INTERVAL + 2))
        finally:
            handle.shutdown()
    d = only(report, "big")
    assert "shm-risk" in [f["kind"] for f in d["findings"]] and code == 1
    shm = [r for r in d["recommendations"] if r["setting"] == "--shm-size"]
    assert shm and shm[0]["value"].endswith("g")


@pytest.mark.slow
def test_a_killed_worker_is_reported_as_lost(served: tuple[CollectorRegistry, str]) -> None:
    reg, url = served
    loader = instrument.DataLoader(SleepDataset(200, 0.05), batch_size=1, num_workers=2,
                                   persistent_workers=True, name="lost", registry=reg)
    from dataloader_exporter.instrument import compat

    def train() -> None:
        it = iter(loader)
        next(it)
        victim = compat.worker_pids(it)[0]
        # torch's SIGCHLD handler raises in the main thread: let it land in a sleep (see
        # test_worker_liveness), then the loop gets torch's own error.
        with contextlib.suppress(RuntimeError):
            os.kill(victim, signal.SIGKILL)
            time.sleep(10)
        with contextlib.suppress(RuntimeError):
            for _ in it:
                pass
        time.sleep(INTERVAL + 1)  # the process lives on; the doctor looks meanwhile
        del it

    code, report = doctor(url, train)
    d = only(report, "lost")
    assert "lost-workers" in [f["kind"] for f in d["findings"]] and code == 1


def test_unreadable_metrics_exit_two() -> None:
    result = subprocess.run([sys.executable, "-m", "dataloader_exporter", "doctor", "--url",
                             "http://127.0.0.1:9/metrics", "--interval", "0.1"],
                            capture_output=True, text=True, timeout=30, cwd=REPO)
    assert result.returncode == 2 and "cannot read the metrics" in result.stderr


def test_metrics_without_loaders_exit_two(served: tuple[CollectorRegistry, str]) -> None:
    _, url = served
    result = subprocess.run([sys.executable, "-m", "dataloader_exporter", "doctor", "--url", url,
                             "--interval", "0.1"], capture_output=True, text=True, timeout=30,
                            cwd=REPO)
    assert result.returncode == 2 and "no DataLoader metrics" in result.stderr


@pytest.mark.slow  # `prometheus`: a real Prometheus
def test_the_doctor_reads_a_time_range_from_prometheus(
        served: tuple[CollectorRegistry, str], prometheus: Prometheus) -> None:
    """The whole chain for --prometheus: a real loader with a worker, scraped by a real
    Prometheus, read back as a range; the worker's time from /proc says why it is slow."""
    reg, url = served
    loader = instrument.DataLoader(SleepDataset(64, 0.004), batch_size=2, num_workers=1,
                                   persistent_workers=True, name="ranged", registry=reg)
    prometheus.add_target("doctor", url.removeprefix("http://").removesuffix("/metrics"))
    try:
        def seen(query: str) -> bool:
            result = prometheus.query(query)
            return bool(result) and float(result[0]["value"][1]) > 0

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # train until Prometheus has rates to show
            train_for(loader, 1.0)
            if seen('increase(dataloader_batches_total{test="doctor"}[1m])') and seen(
                    'increase(dataloader_worker_time_seconds_total'
                    '{test="doctor",state="blocked"}[1m])'):
                break
        train_for(loader, 2.0)
        result = subprocess.run(
            [sys.executable, "-m", "dataloader_exporter", "doctor", "--prometheus", prometheus.url,
             "--range", "60", "--match", 'test="doctor"', "--format", "json"],
            capture_output=True, text=True, timeout=60, cwd=REPO)
    finally:
        prometheus.remove_target("doctor")
    assert result.returncode == 1, result.stderr
    d = only(json.loads(result.stdout), "ranged")
    assert d["verdict"] == "input-bound"
    # The worker sleeps in its dataset: blocked, not running, while the loop waits. On a
    # busy machine each wake-up also waits for a CPU, which may then be the verdict.
    workers = d["workers"]
    assert workers["bottleneck"] in ("blocked", "cpu_contention"), workers
    assert workers["blocked_share"] > 0.5 and workers["rss_bytes"] > 0, workers
    assert workers["blocked_share"] > 2 * workers["running_share"], workers


def tuner_of(reg: CollectorRegistry, name: str) -> tuple[float | None, dict[str, float]]:
    """A loader's tuner as its registry exports it: the stable gauge (None: not tuned)
    and its changes by "setting reason"."""
    stable, changes = None, {}
    for family in reg.collect():
        for s in family.samples:
            if s.labels.get("loader") != name:
                continue
            if s.name == cat.TUNER_STABLE.name:
                stable = s.value
            elif s.name == cat.TUNER_CHANGES.name and s.value:  # each starts at 0
                changes[f"{s.labels['setting']} {s.labels['reason']}"] = s.value
    return stable, changes


def tune_until_stable(loader: Any, reg: CollectorRegistry, timeout: float = 60) -> None:
    """Epochs of a tuned loader until its tuner is stable (a few: it stops after
    core/tuner/rules.MAX_TRIALS at the most)."""
    end = time.monotonic() + timeout
    while tuner_of(reg, loader._instruments.name)[0] != 1 and time.monotonic() < end:
        for _ in loader:
            pass
    assert tuner_of(reg, loader._instruments.name)[0] == 1


def expected_tuner(loader: Any, changes: dict[str, float], state: str = "stable"
                   ) -> dict[str, Any]:
    """The report's `tuner` for a tuned loader (stable, or trying once more): the settings
    it runs with now."""
    return {"state": state, "num_workers": loader.num_workers,
            "prefetch_factor": loader.prefetch_factor if loader.num_workers else None,
            "changes": sum(changes.values()),
            "held": [] if state == "stable" else ["num_workers", "prefetch_factor"],
            "settings": ["num_workers", "prefetch_factor"], "persistent": None,
            "by_reason": [{"setting": k.split()[0], "reason": k.split()[1], "count": v}
                          for k, v in sorted(changes.items())]}


@pytest.mark.slow
def test_a_tuned_loader_is_reported_with_the_settings_and_changes_the_tuner_made(
        served: tuple[CollectorRegistry, str]) -> None:
    """A real tuned loader (it starts without workers and waits for its samples: the
    tuner adds a worker) read by the real CLI: stable, its settings now, its changes as
    the registry counts them, and `auto` kept in the env line."""
    reg, url = served
    loader = instrument.DataLoader(SleepDataset(64, 0.002), batch_size=4, tune=True,
                                   name="tuned", registry=reg)
    untuned = instrument.DataLoader(SleepDataset(64, 0.002), batch_size=4, name="untuned",
                                    registry=reg)
    tune_until_stable(loader, reg)
    train_for(untuned, 0.2)
    _, report = doctor(url, lambda: train_for(loader, INTERVAL + 1.0))
    _, changes = tuner_of(reg, "tuned")
    assert changes, "the tuner made no change: a starved loader without workers gets one"
    d = only(report, "tuned")
    assert d["tuner"] == expected_tuner(loader, changes)
    assert only(report, "untuned")["tuner"] is None
    result = subprocess.run([sys.executable, "-m", "dataloader_exporter", "doctor", "--url",
                             url, "--interval", "0.2", "--format", "env"],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    [line] = result.stdout.splitlines()
    assert line.startswith(f"{ENV_SETTINGS}=tuned.num_workers=auto,tuned.prefetch_factor=auto")


@pytest.mark.slow  # `prometheus`: a real Prometheus
def test_the_doctor_reads_a_tuned_loader_from_prometheus_at_its_settings_now(
        served: tuple[CollectorRegistry, str], prometheus: Prometheus) -> None:
    """Through a real Prometheus: dataloader_info changes its labels when the tuner changes
    num_workers, and the range holds every label set; the doctor takes the newest."""
    reg, url = served
    # Epochs of 1.6 s: each setting the tuner tries lasts over a scrape.
    loader = instrument.DataLoader(SleepDataset(32, 0.05), batch_size=2, tune=True,
                                   name="tuned", registry=reg)
    prometheus.add_target("doctor-tuned", url.removeprefix("http://").removesuffix("/metrics"))
    try:
        train_for(loader, 0.1)  # the tuner starts with the first iter(): stable 0
        prometheus.wait_for(f'{cat.TUNER_STABLE.name}{{test="doctor-tuned"}} == 0', timeout=30)
        tune_until_stable(loader, reg)
        prometheus.wait_for(f'{cat.TUNER_STABLE.name}{{test="doctor-tuned"}} == 1', timeout=30)
        train_for(loader, 1.0)
        # A stable tuner may try once more (a drift, a doubt) while it trains: the doctor
        # reads once Prometheus holds the state and every change the registry has now.
        stable, changes = tuner_of(reg, "tuned")
        prometheus.wait_for(f'sum({cat.TUNER_CHANGES.name}{{test="doctor-tuned"}}) == '
                            f'{sum(changes.values()):g}', timeout=30)
        prometheus.wait_for(f'{cat.TUNER_STABLE.name}{{test="doctor-tuned"}} == {stable:g}',
                            timeout=30)
        result = subprocess.run(
            [sys.executable, "-m", "dataloader_exporter", "doctor", "--prometheus",
             prometheus.url, "--range", "60", "--match", 'test="doctor-tuned"', "--format",
             "json"], capture_output=True, text=True, timeout=60, cwd=REPO)
        label_sets = prometheus.query(
            f'count(last_over_time({cat.INFO.name}{{test="doctor-tuned"}}[60s]))')
    finally:
        prometheus.remove_target("doctor-tuned")
    assert result.returncode in (0, 1), result.stderr
    _, changes = tuner_of(reg, "tuned")
    assert changes and float(label_sets[0]["value"][1]) >= 2  # a label set before the change
    assert only(json.loads(result.stdout), "tuned")["tuner"] == expected_tuner(
        loader, changes, "stable" if stable == 1 else "trying")


def machine(storage: str = "nvme", cores: int = 8) -> Machine:
    return Machine(cores, None, 64 << 30, 32 << 30, 64 << 20, storage, "/data")


def starved_signals(workers: int) -> LoaderSignals:
    s = LoaderSignals("t", "0", seconds=10, fetch_seconds=8, step_seconds=2, batches=100,
                      samples=3200, batch_bytes=1 << 20, workers_configured=workers,
                      gpu_utilization=0.4)
    s.config = {"num_workers": str(workers), "prefetch_factor": "2",
                "persistent_workers": "true", "pin_memory": "true"}
    return s


@pytest.mark.parametrize(("storage", "cores", "expected"), [
    ("nvme", 16, 12), ("ssd", 16, 4), ("rotational", 16, 4), ("network", 4, 16),
    ("nvme", 4, 4), ("unknown", 6, 6)])
def test_recommended_workers_follow_cores_and_storage(storage: str, cores: int,
                                                      expected: int) -> None:
    d = diagnose(starved_signals(1), machine(storage, cores))
    [rec] = [r for r in d.recommendations if r.setting == "num_workers"]
    assert int(rec.value) == expected


def test_without_a_gpu_one_core_stays_with_the_training_loop() -> None:
    s = starved_signals(0)
    s.gpu_utilization = None
    d = diagnose(s, machine("nvme", 8))
    [rec] = [r for r in d.recommendations if r.setting == "num_workers"]
    assert rec.value == "7" and "a core for the training loop" in rec.why


def test_too_many_workers_for_the_cores_per_rank_are_cut_back() -> None:
    d = diagnose(starved_signals(8), machine("nvme", 8), local_ranks=4)
    [rec] = [r for r in d.recommendations if r.setting == "num_workers"]
    assert rec.value == "2" and "fight for CPU" in rec.why


def test_quantile_interpolates_like_prometheus() -> None:
    buckets = [(0.1, 0.0), (0.2, 50.0), (0.4, 100.0), (float("inf"), 100.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.2)
    assert quantile(0.75, buckets) == pytest.approx(0.3)
    assert quantile(0.5, []) is None


def test_storage_kind_reads_mounts_and_sysfs(tmp_path: Path) -> None:
    (tmp_path / "mounts").write_text("server:/export /mnt/data nfs4 rw 0 0\n"
                                     "/dev/nvme0n1p2 / ext4 rw 0 0\n"
                                     "/dev/sda1 /sata ext4 rw 0 0\n")
    for dev, rot in (("sda", "0"),):
        (tmp_path / "block" / dev / "queue").mkdir(parents=True)
        (tmp_path / "block" / dev / "queue" / "rotational").write_text(rot + "\n")
    kind = lambda p: storage_kind(p, str(tmp_path / "mounts"), str(tmp_path / "block"))  # noqa: E731
    assert kind("/mnt/data/x") == "network"
    assert kind("/home") == "nvme"
    assert kind("/sata/img") == "ssd"
