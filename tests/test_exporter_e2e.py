"""A real trainer run, a real exporter process, a real Prometheus, and load on the exporter."""

from __future__ import annotations

import concurrent.futures
import urllib.request
from pathlib import Path

import psutil
import pytest
from prometheus_client import CollectorRegistry
from support.helpers import wait_for_write
from support.procs import Exporter, Prometheus, scalar
from support.torch_helpers import BurnDataset

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.instrument.hub import hub_for

pytestmark = [pytest.mark.torch, pytest.mark.slow]


def trainer_run(metrics_dir: Path) -> None:
    """3 epochs x 4 batches of 2 over real workers, snapshots into metrics_dir."""
    reg = CollectorRegistry()
    loader = instrument.DataLoader(BurnDataset(8, 0.002), batch_size=2, num_workers=2,
                                   persistent_workers=True, name="train",
                                   metrics_dir=str(metrics_dir), registry=reg)
    for _ in range(3):
        for x, _ in loader:
            loader.to_device(x, "meta")
    assert wait_for_write(hub_for(reg).write_snapshots(str(metrics_dir)))
    hub_for(reg).close()  # no thread left writing for the rest of the test run


def test_a_real_runs_metrics_reach_prometheus_through_the_sidecar(
        tmp_path: Path, prometheus: Prometheus) -> None:
    metrics = tmp_path / "metrics"
    trainer_run(metrics)
    exp = Exporter(f"--metrics-dir={metrics}", "--stale-after=3600")
    try:
        prometheus.add_target("e2e", exp.address)
        sel = '{test="e2e",loader="train",rank="0"}'
        prometheus.wait_for(cat.BATCHES.name + sel)
        assert scalar(prometheus.query(cat.BATCHES.name + sel)) == 12
        assert scalar(prometheus.query(cat.SAMPLES.name + sel)) == 24
        assert scalar(prometheus.query(cat.EPOCHS.name + sel)) == 3
        assert scalar(prometheus.query(cat.WORKERS_CONFIGURED.name + sel)) == 2
        assert scalar(prometheus.query(cat.TRANSFER_BYTES.name + sel)) == 12 * 2 * 4 * 4
        fetch = f'{cat.TIME.name}_count{{test="e2e",loader="train",phase="fetch"}}'
        assert scalar(prometheus.query(fetch)) == 12
        cpu = prometheus.query(f'sum({cat.WORKER_CPU.name}{{test="e2e"}})')
        assert 0.9 * 24 * 0.002 < scalar(cpu) < 10
        info = prometheus.query(cat.INFO.name + '{test="e2e",persistent_workers="true"}')
        assert scalar(info) == 1
        for collector, up in (("trainer", 1), ("shm", 1), ("host", 1), ("gpu", 0)):
            q = f'{cat.COLLECTOR_UP.name}{{test="e2e",collector="{collector}"}}'
            assert scalar(prometheus.query(q)) == up, collector
        assert scalar(prometheus.query(cat.SHM_SIZE.name + '{test="e2e"}')) > 0
        assert scalar(prometheus.query(cat.HOST_MEMORY_AVAILABLE.name + '{test="e2e"}')) > 0
        assert scalar(prometheus.query('up{test="e2e"}')) == 1
    finally:
        prometheus.remove_target("e2e")
        exp.stop()


def test_fifty_clients_and_five_thousand_scrapes_without_errors_or_memory_growth(
        tmp_path: Path) -> None:
    metrics = tmp_path / "metrics"
    trainer_run(metrics)
    exp = Exporter(f"--metrics-dir={metrics}", "--stale-after=3600")
    proc = psutil.Process(exp.proc.pid)

    def scrape(_: int) -> int:
        with urllib.request.urlopen(exp.url + "/metrics", timeout=30) as r:
            body = r.read()
            assert cat.BATCHES.name.encode() in body
            return int(r.status)

    try:
        with concurrent.futures.ThreadPoolExecutor(50) as pool:
            assert set(pool.map(scrape, range(500))) == {200}  # warm-up
            before = proc.memory_info().rss
            statuses = list(pool.map(scrape, range(5000)))
        after = proc.memory_info().rss
        assert statuses.count(200) == 5000
        growth_mb = (after - before) / 2**20
        assert growth_mb < 8, f"RSS grew {growth_mb:.1f} MB over 5000 scrapes"
    finally:
        assert exp.stop() == 0
