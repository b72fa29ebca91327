"""The compose stack: validated by the real Compose v2 binary, and run without containers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import compose
import pytest
import yaml
from procs import REPO, Exporter, Prometheus, scalar

from exporter import catalogue as cat

COMPOSE = Path(compose.__file__).parent / "docker-compose"
ENV = {**os.environ, "GRAFANA_ADMIN_PASSWORD": "test-only-password"}


def compose_config(*files: Path, env: dict[str, str] | None = None,
                   cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """`docker-compose config` through the binary itself (its Python wrapper exits 0)."""
    args = [str(COMPOSE)]
    for f in files:
        args += ["-f", str(f)]
    return subprocess.run([*args, "config", "-q"], capture_output=True, text=True, cwd=cwd,
                          env=ENV if env is None else env, timeout=60)


def stack() -> dict[str, Any]:
    return dict(yaml.safe_load((REPO / "docker-compose.yml").read_text()))


def test_the_compose_file_and_the_gpu_override_are_valid() -> None:
    assert COMPOSE.is_file()
    ok = compose_config(REPO / "docker-compose.yml")
    assert ok.returncode == 0, ok.stderr
    gpu = compose_config(REPO / "docker-compose.yml", REPO / "docker-compose.gpu.yml")
    assert gpu.returncode == 0, gpu.stderr


@pytest.mark.parametrize(("old", "new"), [
    ("restart: unless-stopped", "restart: unless-stopped\n    bogus_key: 1"),
    ("condition: service_started", "condition: service_started\n      nosuch:\n"
                                   "        condition: service_started"),
    ("shm_size: 512m", "shm_size: [512m]"),
])
def test_a_broken_copy_of_the_compose_file_fails(tmp_path: Path, old: str, new: str) -> None:
    text = (REPO / "docker-compose.yml").read_text()
    assert old in text
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace(old, new, 1))
    result = compose_config(broken, cwd=tmp_path)
    assert result.returncode != 0


def test_grafana_refuses_to_start_without_an_admin_password() -> None:
    env = {k: v for k, v in ENV.items() if k != "GRAFANA_ADMIN_PASSWORD"}
    result = compose_config(REPO / "docker-compose.yml", env=env)
    assert result.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in result.stderr
    example = dict(line.split("=", 1) for line in (REPO / ".env.example").read_text()
                   .splitlines() if line and not line.startswith("#"))
    assert example["GRAFANA_ADMIN_PASSWORD"] not in ("", "admin")


def test_ports_are_local_images_pinned_and_services_healthchecked() -> None:
    services = stack()["services"]
    assert set(services) == {"trainer", "exporter", "prometheus", "grafana"}
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)
        image = svc["image"]
        assert ":" in image and not image.endswith(":latest"), image
        assert "healthcheck" in svc and svc["restart"] == "unless-stopped", name
    assert services["trainer"]["shm_size"] and services["exporter"]["ipc"] == "service:trainer"
    assert set(stack()["volumes"]) >= {"metrics", "prometheus-data", "grafana-data"}


def _dockerfile_copies(dockerfile: Path) -> list[str]:
    sources = []
    for line in dockerfile.read_text().splitlines():
        parts = line.split()
        if parts and parts[0] == "COPY" and not parts[1].startswith("--from"):
            sources += parts[1:-1]
    return sources


def test_every_file_compose_mounts_or_a_dockerfile_copies_exists() -> None:
    for name, svc in stack()["services"].items():
        build = svc.get("build")
        if build:
            context = REPO / build["context"]
            dockerfile = context / build.get("dockerfile", "Dockerfile")
            assert dockerfile.is_file(), (name, dockerfile)
            for src in _dockerfile_copies(dockerfile):
                assert (context / src).exists(), (name, src)
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (REPO / source).exists(), (name, source)


def test_the_exporter_image_is_what_compose_runs() -> None:
    exporter = stack()["services"]["exporter"]
    dockerfile = REPO / exporter["build"]["dockerfile"]
    assert '"dataloader-exporter", "serve"' in dockerfile.read_text()
    assert any(str(a).startswith("--metrics-dir=") for a in exporter["command"])


def test_prometheus_config_passes_promtool(promtool: str) -> None:
    result = subprocess.run([promtool, "check", "config",
                             str(REPO / "deploy" / "prometheus" / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    targets = [t for job in config["scrape_configs"] for sc in job.get("static_configs", [])
               for t in sc["targets"]]
    port = re.search(r":(\d+)", stack()["services"]["exporter"]["ports"][0])
    assert port and f"exporter:{port.group(1)}" in targets


def test_the_same_topology_without_containers_reaches_prometheus(
        tmp_path: Path, prometheus: Prometheus) -> None:
    """A trainer process and a sidecar process share a directory; Prometheus scrapes."""
    metrics = tmp_path / "metrics"
    trainer = subprocess.Popen(
        [sys.executable, str(REPO / "examples" / "train.py"), "--epochs", "0", "--workers", "1",
         "--samples", "64", "--metrics-dir", str(metrics)], stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, cwd=tmp_path)
    exporter = None
    try:
        assert _wait_for_files(metrics), "the trainer wrote no snapshot"
        exporter = Exporter(f"--metrics-dir={metrics}", "--no-collector.gpu")
        prometheus.add_target("topology", exporter.address)
        sel = '{test="topology",loader="train",rank="0"}'
        prometheus.wait_for(cat.BATCHES.name + sel, lambda r: bool(r) and scalar(r) > 0)
        first = scalar(prometheus.query(cat.BATCHES.name + sel))
        # The trainer keeps training: Prometheus sees the counter grow through the sidecar.
        prometheus.wait_for(cat.BATCHES.name + sel, lambda r: bool(r) and scalar(r) > first)
        assert scalar(prometheus.query(cat.WORKERS_CONFIGURED.name + sel)) == 1
    finally:
        prometheus.remove_target("topology")
        if exporter is not None:
            exporter.stop()
        trainer.terminate()
        trainer.wait(timeout=30)


def _wait_for_files(directory: Path, timeout: float = 60.0) -> list[Path]:
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        files = list(directory.glob("*.prom")) if directory.is_dir() else []
        if files:
            return files
        time.sleep(0.1)
    return []
