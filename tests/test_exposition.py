"""Our fast encoders write what prometheus_client's encoders write, for real registries."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Histogram,
    Info,
    Summary,
    generate_latest,
)
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from support.torch_helpers import SleepDataset

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.exporter import exposition
from dataloader_exporter.exporter.collectors.supervisor import Supervisor
from dataloader_exporter.exporter.collectors.trainer import TrainerCollector
from dataloader_exporter.exporter.sources import system_sources

pytestmark = pytest.mark.torch


def busy_registry(tmp_path: Path) -> CollectorRegistry:
    """Trainer series (through a snapshot file), system collectors, and odd label values."""
    trainer = CollectorRegistry()
    loader = instrument.DataLoader(SleepDataset(8), batch_size=2, num_workers=2,
                                   name='odd "name"\\ with\nnewline', registry=trainer)
    for x, _ in loader:
        loader.to_device(x, "meta")
    (tmp_path / "a.prom").write_bytes(generate_latest(trainer))
    reg = CollectorRegistry()
    reg.register(Supervisor([TrainerCollector(str(tmp_path)),
                             *system_sources(gpu=False)]))
    plain = CollectorRegistry()
    Counter("plain_events", "Events with a\\backslash.", ["kind"], registry=plain).labels(
        'x"y').inc(3)
    Gauge("plain_big", "Big values.", registry=plain).set(1.5e17)
    Histogram("plain_wait_seconds", "A histogram.", registry=plain).observe(0.3)
    # What a user's own registry may also hold, served in-process beside the loaders'.
    Info("plain_build", "Build facts.", registry=plain).info({"version": "1"})
    Enum("plain_state", "A state.", states=["a", "b"], registry=plain).state("b")
    Summary("plain_latency_seconds", "A summary.", registry=plain).observe(0.2)
    Gauge("plain_temperature", "With a unit.", unit="celsius", registry=plain).set(21)
    Counter("plain_hits", "With an exemplar.", registry=plain).inc(
        exemplar={"trace_id": "abc"})
    reg.register(_Both(plain))
    return reg


class _Both:
    def __init__(self, other: CollectorRegistry) -> None:
        self.other = other

    def collect(self):  # type: ignore[no-untyped-def]
        return self.other.collect()


def test_text_output_is_byte_identical_to_prometheus_clients(tmp_path: Path) -> None:
    reg = busy_registry(tmp_path)
    families = list(reg.collect())

    class Fixed:
        def collect(self):  # type: ignore[no-untyped-def]
            return families

    fixed = CollectorRegistry()
    fixed.register(Fixed())
    assert exposition.text(families) == generate_latest(fixed)
    assert exposition.openmetrics(families) == om_generate_latest(fixed)


def test_openmetrics_output_parses_back_to_the_same_families(tmp_path: Path) -> None:
    families = list(busy_registry(tmp_path).collect())
    parsed = {f.name: f for f in om_parse(exposition.openmetrics(families).decode())}
    for f in families:
        assert [(s.name, s.labels, s.value) for s in parsed[f.name].samples] == [
            (s.name, s.labels, s.value) for s in f.samples]


def test_promtool_accepts_the_text_output(tmp_path: Path, promtool: str) -> None:
    body = exposition.text(busy_registry(tmp_path).collect())
    result = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True,
                            timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_sidecar_serves_a_trainers_families_exactly_as_the_trainer_wrote_them(
        tmp_path: Path) -> None:
    """Not circular: the writer's own encoding of its registry, against what the sidecar
    makes of the file (parsed, validated, re-encoded once per version)."""
    trainer = CollectorRegistry()
    loader = instrument.DataLoader(SleepDataset(6), batch_size=2, num_workers=2,
                                   name='odd "name"\\ with\nnewline', registry=trainer)
    for x, _ in loader:
        loader.to_device(x, "meta")
    written = generate_latest(trainer)
    (tmp_path / "a.prom").write_bytes(written)
    reg = CollectorRegistry()
    reg.register(Supervisor([TrainerCollector(str(tmp_path))]))
    trainer_names = {m.family for m in cat.ALL if m.source == cat.TRAINER}
    served = exposition.text(f for f in reg.collect() if f.name in trainer_names)

    def blocks(body: bytes) -> set[str]:
        """Each family with samples (one with none, like the /proc figures of workers
        never read, is written by the trainer as its HELP and TYPE lines alone)."""
        return {"# HELP " + b for b in body.decode().split("# HELP ")
                if any(line and not line.startswith("#") for line in b.splitlines()[1:])}

    assert blocks(served) == blocks(written)
