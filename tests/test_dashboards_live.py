"""Live: a real Prometheus scrapes a real exporter serving a real instrumented DataLoader
run; every dashboard query (variables expanded) and every alert expression goes through
Prometheus's HTTP API. None may error, and the core panels must show data."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.procs import REPO, Exporter, Prometheus, finish, scalar
from support.required import require_binary

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.dashboards import build, recording
from dataloader_exporter.dashboards.alerts import ALERTS
from dataloader_exporter.dashboards.render import render

pytestmark = [pytest.mark.torch, pytest.mark.slow]

TARGET = "dashboards-live"
# A trainer that keeps training until told to stop (or 600 s pass): 2 workers, epochs of
# 8 batches, to_device onto the meta device so transfer metrics exist, a 5 ms "step". After
# each of its epochs, one of a second loader that the loader tuner tunes: it starts without
# workers and its loop only waits for samples, so the tuner adds a worker (then keeps it or
# goes back) and is stable within a few epochs.
TUNED = "tuned"
TRAINER = f"""
import os, sys, time
from dataloader_exporter import instrument
from support.torch_helpers import SleepDataset
metrics_dir, stop = sys.argv[1], sys.argv[2]
loader = instrument.DataLoader(SleepDataset(32, 0.002), batch_size=4, num_workers=2,
                               persistent_workers=True, name="train", metrics_dir=metrics_dir)
tuned = instrument.DataLoader(SleepDataset(64, 0.002), batch_size=4, tune=True,
                              name="{TUNED}", metrics_dir=metrics_dir)
end = time.monotonic() + 600  # a safety net: the fixture stops it
while time.monotonic() < end and not os.path.exists(stop):
    for x, _ in loader:
        loader.to_device(x, "meta")
        time.sleep(0.005)
    for _ in tuned:
        pass
"""
CORE_PANELS = {"Input stall share", "Fetch wait per batch", "Throughput: samples per second",
               "Throughput: batches per second", "Workers active against configured",
               "/dev/shm used against size",
               # From /proc: Linux, as the trainer here runs (2 workers).
               "Worker time by state", "Worker memory"}
# Panels of tuned loaders only: data for the tuned loader, none for "train".
TUNER_PANELS = {"Loader tuner stable", "Loader tuner changes by setting and reason",
                "Tuned loaders: num_workers and changes"}


@dataclass
class Live:
    prometheus: Prometheus
    values: dict[str, str]  # dashboard variable -> its value in this run
    address: str  # the exporter's host:port

    def expand(self, expr: str) -> str:
        """Substitutes the dashboard's variables as Grafana would for these selections
        (leaving what names no variable, such as label_replace's $1, as it is)."""
        return re.sub(r"\$\{?(\w+)\}?", lambda m: self.values.get(m.group(1), m.group(0)),
                      expr)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, prometheus: Prometheus) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("live")
    metrics, stop = tmp / "metrics", tmp / "stop"
    metrics.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(metrics), str(stop)],
                               cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    exporter = Exporter(f"--metrics-dir={metrics}")
    prometheus.add_target(TARGET, exporter.address)
    try:
        # rate() needs two samples that differ: wait for batches to grow between scrapes.
        sel = f'{cat.BATCHES.name}{{test="{TARGET}"}}'
        prometheus.wait_for(f"rate({sel}[1m]) > 0", timeout=40)
        # Grafana escapes a multi-value variable's regex characters inside the PromQL
        # string: 127\\.0\\.0\\.1 (a backslash, escaped).
        instance = re.escape(exporter.address).replace("\\", "\\\\")
        values = {"datasource": "", "job": "dataloader-exporter", "instance": instance,
                  "loader": "train", "rank": "0", "namespace": ".*",
                  "gpu": ".*", "__rate_interval": "1m"}
        yield Live(prometheus, values, exporter.address)
    finally:
        prometheus.remove_target(TARGET)
        finish(trainer, stop, 30)
        assert trainer.stderr is not None
        errors = trainer.stderr.read()
        trainer.stderr.close()
        exporter.stop()
        assert trainer.returncode == 0, errors


def finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


def eventually(live: Live, expr: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The query's result once it has a finite value (rates settle after a few scrapes)."""
    end = time.monotonic() + timeout
    while True:
        result = live.prometheus.query(expr)
        if finite(result) or time.monotonic() > end:
            return result
        time.sleep(0.25)


def test_every_dashboard_query_runs_and_the_core_panels_show_data(live: Live) -> None:
    checked = 0
    for board in build.BOARDS:
        for panel in render(board)["panels"]:
            for target in panel.get("targets", []):
                expr = live.expand(target["expr"])
                if panel["title"] in CORE_PANELS and board.uid == "dataloader-overview":
                    result = eventually(live, expr)
                    assert finite(result), (panel["title"], target["legendFormat"], result)
                else:
                    live.prometheus.query(expr)  # raises on any error Prometheus reports
                checked += 1
    assert checked > 40


def test_the_tuner_panels_show_the_tuned_loader_and_nothing_for_one_that_is_not_tuned(
        live: Live) -> None:
    """With $loader the tuned loader every query of the tuner's panels has data: the stable
    gauge from its first epoch, its changes and num_workers once the tuner made its first
    change. With $loader "train", which is not tuned, none has: absent, not 0."""
    tuned = Live(live.prometheus, {**live.values, "loader": TUNED}, live.address)
    board = next(b for b in build.BOARDS if b.uid == "dataloader-overview")
    shown = [p for p in render(board)["panels"] if p["title"] in TUNER_PANELS]
    assert {p["title"] for p in shown} == TUNER_PANELS
    for panel in shown:
        for target in panel["targets"]:
            result = eventually(tuned, tuned.expand(target["expr"]), timeout=40)
            assert finite(result), (panel["title"], target["legendFormat"], result)
            assert {r["metric"].get("loader") for r in result} == {TUNED}, result
            assert live.prometheus.query(live.expand(target["expr"])) == [], panel["title"]


# Worker memory growth in this run: the workers' PSS and the room from the start; the
# growth the trainer measures once a worker has been read for GROWTH_SPAN seconds and
# GROWTH_READINGS times besides its first (instrument/memgrowth.py); the dataset's largest
# container of Python objects never (SleepDataset holds none), so that query only has to
# run and find nothing.
GROWTH_PANEL = "Worker memory growth"
GROWTH_NEVER_HERE = {cat.DATASET_OBJECTS.name}


def test_the_worker_memory_growth_panel_shows_the_growth_the_room_and_pss(live: Live) -> None:
    board = next(b for b in build.BOARDS if b.uid == "dataloader-overview")
    (panel,) = [p for p in render(board)["panels"] if p["title"] == GROWTH_PANEL]
    shown = 0
    for target in panel["targets"]:
        expr = live.expand(target["expr"])
        if any(name in expr for name in GROWTH_NEVER_HERE):
            assert live.prometheus.query(expr) == [], target["legendFormat"]
            continue
        result = eventually(live, expr, timeout=60)  # the growth: about 20 s from the start
        assert finite(result), (target["legendFormat"], result)
        assert {r["metric"].get("loader") for r in result} == {"train"}, result
        shown += 1
    assert shown == 3  # the growth, the room and PSS


def test_every_variable_query_runs_and_the_overview_ones_list_this_run(live: Live) -> None:
    for board in build.BOARDS:
        for v in render(board)["templating"]["list"]:
            if v["type"] != "query":
                continue
            selector = re.fullmatch(r"label_values\((.+), \w+\)", v["definition"])
            assert selector, v["definition"]
            found = live.prometheus.api(f"label/{v['name']}/values",
                                        **{"match[]": live.expand(selector.group(1))})
            if board.uid == "dataloader-overview":
                assert found, v["name"]
    assert live.values["loader"] in live.prometheus.api(
        "label/loader/values", **{"match[]": cat.BATCHES.name})


def test_every_alert_expression_runs_and_gpu_collector_down_fires_without_nvml(
        live: Live) -> None:
    for alert in ALERTS:
        result = live.prometheus.query(alert.expr)
        assert all(float(r["value"][1]) > 0 for r in result), (alert.name, result)
    down = live.prometheus.query(
        f'{cat.COLLECTOR_UP.name}{{test="{TARGET}",collector="{cat.GPU}"}} == 0')
    if down:  # no NVML on this machine: the alert's expression must pick that up
        (gpu_alert,) = [a for a in ALERTS if a.name == "DataLoaderGpuCollectorDown"]
        assert any(r["metric"].get("test") == TARGET
                   for r in live.prometheus.query(gpu_alert.expr))


def test_the_live_run_shows_a_sane_stall_share(live: Live) -> None:
    """The trainer steps 5 ms and waits for batches of 4 samples x 2 ms over 2 workers:
    the stall share is a real fraction, neither 0 nor 1."""
    panel = next(p for p in render(build.BOARDS[0])["panels"]
                 if p["title"] == "Input stall share")
    result = eventually(live, live.expand(panel["targets"][0]["expr"]))
    share = float(result[0]["value"][1])
    assert 0 < share < 1, share
    assert Path(REPO / "deploy").is_dir()


def test_the_recording_rules_run_in_prometheus_and_agree_with_the_rank_stall_share(
        live: Live, tmp_path: Path) -> None:
    """A second Prometheus with the generated recording rules scrapes the same exporter:
    every rule records (but the GPU one, without NVML here), the job's stall share of this
    single process equals its per-rank share, and the jobs dashboard shows data."""
    rules = tmp_path / "recording.yml"
    rules.write_text(build.files()["prometheus/recording.yml"])
    server = Prometheus(require_binary("prometheus"), tmp_path / "prometheus",
                        rule_files=[str(rules)])
    try:
        server.add_target(TARGET, live.address)
        server.wait_for(f'{recording.INPUT_STALL}{{job="dataloader-exporter"}}',
                        lambda result: finite(result), timeout=40)
        for name in recording.NAMES:
            result = server.query(f'{name}{{job="dataloader-exporter"}}')
            assert bool(result) is (name != recording.GPU), (name, result)
        train = 'loader="train"'
        job = scalar(server.query(f'{recording.INPUT_STALL}{{{train}}}'))
        rank = scalar(server.query(
            f'sum by (job, loader, rank) (rate({cat.TIME.name}_sum{{{train},phase="fetch"}}'
            f'[5m])) / (sum by (job, loader, rank) (rate({cat.TIME.name}_sum{{{train},'
            f'phase="fetch"}}[5m])) + sum by (job, loader, rank) (rate({cat.STEP.name}_sum'
            f'{{{train}}}[5m])))'))
        assert 0 < job < 1 and abs(job - rank) < 0.05, (job, rank)
        jobs = next(b for b in build.BOARDS if b.uid == "dataloader-jobs")
        shown = Live(server, live.values, live.address)
        for panel in render(jobs)["panels"]:
            for target in panel.get("targets", []):
                result = server.query(shown.expand(target["expr"]))
                if "GPU" not in panel["title"]:
                    assert finite(result), (panel["title"], target["expr"])
    finally:
        server.stop()
