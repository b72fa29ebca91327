"""The in-process exposition is valid in every mode, as a user gets it: the default
registry (the README's `port=`), prometheus_client's global REGISTRY, several loaders and
several ports in one process. Both of prometheus_client's parsers accept it, no family or
series appears twice, and a real Prometheus scrapes it with up == 1."""

from __future__ import annotations

import collections
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.parser import text_string_to_metric_families as text_parse
from support.helpers import deadline_poll
from support.procs import REPO, Prometheus, finish, free_port, scalar

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.instrument.hub import Hub, hub_for

pytestmark = [pytest.mark.torch, pytest.mark.slow]

# Exactly the README's usage: no registry anywhere, `port=` on the loaders; a third loader
# on prometheus_client's global REGISTRY (a caller's registry, with its process metrics).
TRAINER = """
import os, sys, time
from prometheus_client import REGISTRY
from dataloader_exporter import DataLoader
from support.torch_helpers import SleepDataset
train_port, eval_port, global_port = map(int, sys.argv[1:4])
stop = sys.argv[4]
train = DataLoader(SleepDataset(16), batch_size=4, num_workers=2, persistent_workers=True,
                   name="train", port=train_port)
evals = DataLoader(SleepDataset(8), batch_size=4, name="eval", port=eval_port)
again = DataLoader(SleepDataset(8), batch_size=4, name="eval", port=train_port)
other = DataLoader(SleepDataset(8), batch_size=4, name="other", port=global_port,
                   registry=REGISTRY)
end = time.monotonic() + 600  # a safety net: the test stops it
while time.monotonic() < end and not os.path.exists(stop):
    for loader in (train, evals, again, other):
        for _ in loader:
            time.sleep(0.002)
"""


def get(url: str, accept: str = "") -> str:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def check_valid(body_text: str, body_om: str) -> set[str]:
    """Both parsers accept the bodies; no family and no series twice. Returns families."""
    families = [f.name for f in text_parse(body_text)]
    assert not [n for n, c in collections.Counter(families).items() if c > 1], families
    om_families = [f.name for f in om_parse(body_om)]  # raises on a clash or a repeat
    assert len(om_families) == len(set(om_families))
    series = [(s.name, tuple(sorted(s.labels.items())))
              for f in text_parse(body_text) for s in f.samples]
    assert len(series) == len(set(series))
    type_lines = [line for line in body_text.splitlines() if line.startswith("# TYPE ")]
    assert len(type_lines) == len(set(type_lines))
    return set(families)


@pytest.fixture
def trainer(tmp_path: Path) -> Iterator[tuple[list[int], subprocess.Popen[bytes]]]:
    ports = [free_port(), free_port(), free_port()]
    stop = tmp_path / "stop"
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, *map(str, ports), str(stop)],
                            cwd=REPO / "tests", stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        yield ports, proc
    finally:
        finish(proc, stop, 20)


def test_every_in_process_mode_serves_a_valid_exposition_that_prometheus_scrapes(
        trainer: tuple[list[int], subprocess.Popen[bytes]], prometheus: Prometheus) -> None:
    ports, proc = trainer
    urls = [f"http://127.0.0.1:{p}/metrics" for p in ports]

    def ready() -> bool:
        try:
            return all(f"{cat.BATCHES.name}{{loader=\"{name}\"" in get(url)
                       for url, name in ((urls[0], "eval"), (urls[2], "other")))
        except OSError:
            return False

    assert deadline_poll(ready, 30), proc.poll()
    om = "application/openmetrics-text; version=1.0.0"
    default = [check_valid(get(u), get(u, om)) for u in urls[:2]]
    assert default[0] == default[1]  # two ports, one registry
    assert {cat.BATCHES.family, cat.SHM_SIZE.name, cat.COLLECTOR_UP.name} <= default[0]
    body = get(urls[0])
    assert body.count(f'{cat.BATCHES.name}{{loader="eval",rank="0"}}') == 1
    glob = check_valid(get(urls[2]), get(urls[2], om))
    assert "process_cpu_seconds" in glob and cat.SHM_SIZE.name in glob
    assert 'loader="train"' not in get(urls[2])  # a registry of its own

    for i, port in enumerate(ports):
        prometheus.add_target(f"inproc{i}", f"127.0.0.1:{port}")
    try:
        for i in range(3):
            sel = f'{{test="inproc{i}"}}'
            prometheus.wait_for(f"scrape_samples_scraped{sel}")
            assert scalar(prometheus.query(f"up{sel}")) == 1
            scraped = scalar(prometheus.query(f"scrape_samples_scraped{sel}"))
            stored = scalar(prometheus.query(
                f'count({{test="inproc{i}",__name__!~"up|scrape_.*"}})'))
            assert stored == scraped  # nothing dropped as a duplicate
    finally:
        for i in range(3):
            prometheus.remove_target(f"inproc{i}")


def test_a_second_hub_or_system_collector_on_one_registry_is_refused() -> None:
    registry = CollectorRegistry()
    hub = hub_for(registry)
    assert hub_for(registry) is hub
    with pytest.raises(ValueError, match="Duplicated"):
        Hub(registry)
    from dataloader_exporter.exporter.sources import attach, system_sources

    attach(registry, system_sources(gpu=False))
    with pytest.raises(ValueError, match="Duplicated"):
        attach(registry, system_sources(gpu=False))
