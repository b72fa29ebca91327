"""The compose stack: validated by the real Compose v2 binary, and run without containers;
its TLS override with deploy/tls/make-certs.sh's output against a real sidecar and a real
Prometheus running the override's config."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import compose
import pytest
import yaml
from support.procs import REPO, Exporter, Prometheus, free_port, http_get, scalar
from support.required import require_binary

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.dashboards import kubernetes
from dataloader_exporter.exporter.web import webconfig

COMPOSE = Path(compose.__file__).parent / "docker-compose"
ENV = {**os.environ, "GRAFANA_ADMIN_PASSWORD": "test-only-password"}
TLS_OVERRIDE = REPO / "docker-compose.tls.yml"
MAKE_CERTS = REPO / "deploy" / "tls" / "make-certs.sh"
MADE = ("ca.crt", "tls.crt", "tls.key", "prometheus-password", "web-config.yml")
USER = "prometheus"  # the scrape user make-certs.sh writes into the web config
WEB_CONFIG_ENV = "DATALOADER_EXPORTER_WEB_CONFIG_FILE"


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


def merged(*overrides: str) -> dict[str, Any]:
    """The services as Compose merges docker-compose.yml with the overrides."""
    files = [REPO / "docker-compose.yml", *(REPO / o for o in overrides)]
    args = [str(COMPOSE)]
    for f in files:
        args += ["-f", str(f)]
    result = subprocess.run([*args, "config", "--format", "json"], capture_output=True,
                            text=True, cwd=REPO, env=ENV, timeout=60)
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout)["services"])


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


@pytest.mark.torch
@pytest.mark.slow  # `prometheus`: a real Prometheus
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


# --- TLS and basic auth: docker-compose.tls.yml and deploy/tls/make-certs.sh ----------------
def test_the_tls_override_is_valid_and_combines_with_the_gpu_override() -> None:
    for files in ((TLS_OVERRIDE,), (REPO / "docker-compose.gpu.yml", TLS_OVERRIDE)):
        result = compose_config(REPO / "docker-compose.yml", *files)
        assert result.returncode == 0, result.stderr
    plain, tls = merged(), merged("docker-compose.gpu.yml", "docker-compose.tls.yml")
    exporter = tls["exporter"]
    assert "--collector.gpu" in exporter["command"]  # the GPU override's command stays
    web_config = Path(exporter["environment"][WEB_CONFIG_ENV])
    assert web_config.name == "web-config.yml"
    for name in ("exporter", "prometheus"):  # deploy/tls, read-only, where both look
        (mount,) = [v for v in tls[name]["volumes"] if v["target"] == str(web_config.parent)]
        assert mount["source"] == str(MAKE_CERTS.parent) and mount["read_only"] is True
    assert str(web_config) == f"{kubernetes.WEB_DIR}/{kubernetes.WEB_CONFIG}"
    # Prometheus: the same flags but the config file, which sits beside the default one.
    before, after = plain["prometheus"]["command"], tls["prometheus"]["command"]
    assert [a for a in after if not a.startswith("--config.file=")] == \
        [a for a in before if not a.startswith("--config.file=")]
    (config,) = [a.split("=", 1)[1] for a in after if a.startswith("--config.file=")]
    (etc,) = [v["target"] for v in tls["prometheus"]["volumes"]
              if v["source"] == str(REPO / "deploy" / "prometheus")]
    assert (REPO / "deploy" / "prometheus" / Path(config).relative_to(etc)).is_file()


def test_make_certs_output_is_git_ignored_and_the_script_is_not() -> None:
    git = require_binary("git")
    for name in MADE:
        path = MAKE_CERTS.parent / name
        result = subprocess.run([git, "check-ignore", "-q", "--no-index", str(path)],
                                cwd=REPO, timeout=30)
        assert result.returncode == 0, f"{name} is not git-ignored"
    result = subprocess.run([git, "check-ignore", "-q", "--no-index", str(MAKE_CERTS)],
                            cwd=REPO, timeout=30)
    assert result.returncode == 1


def make_certs(directory: Path) -> Path:
    """Runs deploy/tls/make-certs.sh into `directory` with this interpreter's bcrypt."""
    require_binary("openssl")
    result = subprocess.run(["sh", str(MAKE_CERTS), str(directory)], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(p.name for p in directory.iterdir()) == sorted(MADE)  # no CA key left
    return directory


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_sidecar(certs: Path) -> Iterator[Exporter]:
    """The real sidecar with the generated web config, as the flag names it."""
    exporter = Exporter("--no-collector.gpu", f"--web.config.file={certs / 'web-config.yml'}")
    yield exporter
    assert exporter.stop() == 0


def get(url: str, certs: Path, password: str | None) -> int:
    """The status of a GET over https, checked against the generated CA."""
    headers = {}
    if password is not None:
        token = base64.b64encode(f"{USER}:{password}".encode()).decode()
        headers["Authorization"] = f"Basic {token}"
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    context=context, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


@pytest.mark.slow
def test_make_certs_writes_a_web_config_that_loads_with_paths_beside_it(certs: Path) -> None:
    raw = yaml.safe_load((certs / "web-config.yml").read_text())
    assert raw["tls_server_config"] == {"cert_file": "tls.crt", "key_file": "tls.key"}
    config = webconfig.load(str(certs / "web-config.yml"))
    assert config.tls is not None and config.tls.cert_file == str(certs / "tls.crt")
    assert set(config.users) == {USER}
    password = (certs / "prometheus-password").read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", password)  # no newline, under bcrypt's 72 bytes
    assert config.authorized("Basic " + base64.b64encode(f"{USER}:{password}".encode())
                             .decode())
    assert not config.authorized("Basic " + base64.b64encode(f"{USER}:x".encode()).decode())


@pytest.mark.slow
def test_the_sidecar_serves_https_with_the_generated_ca_and_password_and_401_without(
        certs: Path, tls_sidecar: Exporter) -> None:
    url = tls_sidecar.url
    assert url.startswith("https://127.0.0.1:")
    password = (certs / "prometheus-password").read_text()
    assert get(url + "/metrics", certs, password) == 200
    for path in ("/metrics", "/-/healthy"):  # every path, as exporter-toolkit
        assert get(url + path, certs, None) == 401
        assert get(url + path, certs, "not-the-password") == 401


@pytest.mark.parametrize("name", ["exporter", kubernetes.SERVER_NAME, "localhost"])
def test_the_generated_certificate_holds_the_names_compose_and_the_pod_monitor_use(
        certs: Path, tls_sidecar: Exporter, name: str) -> None:
    """compose scrapes exporter:9478; the PodMonitor scrapes pod IPs with serverName."""
    host, port = tls_sidecar.address.rsplit(":", 1)
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    with socket.create_connection((host, int(port)), timeout=10) as sock, \
            context.wrap_socket(sock, server_hostname=name) as tls:
        assert tls.version() in ("TLSv1.2", "TLSv1.3")
    with socket.create_connection((host, int(port)), timeout=10) as sock, \
            pytest.raises(ssl.SSLCertVerificationError):
        context.wrap_socket(sock, server_hostname="elsewhere.example.com")


def healthcheck(certs: Path, port: int) -> subprocess.CompletedProcess[str]:
    """The TLS override's exporter healthcheck, with deploy/tls at `certs`, the port at
    `port`, run by this interpreter (the image's python would do the same)."""
    override = yaml.safe_load(TLS_OVERRIDE.read_text())["services"]["exporter"]
    cmd, python, flag, code = override["healthcheck"]["test"]
    assert (cmd, python, flag) == ("CMD", "python", "-c")
    (mount,) = [v.split(":")[1] for v in override["volumes"] if v.startswith("./deploy/tls:")]
    assert code.count(f"'{mount}/'") == 1 and code.count(":9478/") == 1
    code = code.replace(f"'{mount}/'", repr(f"{certs}/")).replace(":9478/", f":{port}/")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30)


def test_the_tls_healthcheck_passes_on_the_sidecar_and_fails_with_a_wrong_password(
        certs: Path, tls_sidecar: Exporter, tmp_path: Path) -> None:
    port = int(tls_sidecar.address.rsplit(":", 1)[1])
    ok = healthcheck(certs, port)
    assert ok.returncode == 0, ok.stderr
    wrong = tmp_path / "wrong"
    shutil.copytree(certs, wrong)
    (wrong / "prometheus-password").write_text("0" * 64)
    failed = healthcheck(wrong, port)
    assert failed.returncode != 0 and "401" in failed.stderr


def tls_prometheus_config(directory: Path, certs: Path, target: str) -> Path:
    """deploy/prometheus with prometheus-tls.yml's paths into deploy/tls pointed at `certs`,
    its exporter target at `target` and its scrape interval at 1 s; nothing else changed."""
    shutil.copytree(REPO / "deploy" / "prometheus", directory)
    exporter = yaml.safe_load(TLS_OVERRIDE.read_text())["services"]["exporter"]
    (mount,) = [v.split(":")[1] for v in exporter["volumes"] if v.startswith("./deploy/tls:")]
    path = directory / "prometheus-tls.yml"
    text = path.read_text()
    assert text.count(f"{mount}/") == 2
    config = yaml.safe_load(text.replace(f"{mount}/", f"{certs}/"))
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "dataloader-exporter"]
    assert job["static_configs"] == [{"targets": ["exporter:9478"]}]
    job["static_configs"], job["scrape_interval"] = [{"targets": [target]}], "1s"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_tls_prometheus_config_keeps_the_default_one_but_scheme_tls_and_auth() -> None:
    folder = REPO / "deploy" / "prometheus"
    plain = yaml.safe_load((folder / "prometheus.yml").read_text())
    tls = yaml.safe_load((folder / "prometheus-tls.yml").read_text())
    (job,) = [j for j in tls["scrape_configs"] if j["job_name"] == "dataloader-exporter"]
    assert job.pop("scheme") == "https"
    assert set(job.pop("tls_config")) == {"ca_file"}
    assert job.pop("basic_auth")["username"] == USER
    assert tls == plain  # the same rule files, targets and intervals


@pytest.mark.slow
def test_the_tls_prometheus_config_passes_promtool_and_scrapes_the_sidecar(
        certs: Path, tls_sidecar: Exporter, promtool: str, tmp_path: Path) -> None:
    config = tls_prometheus_config(tmp_path / "prometheus", certs, tls_sidecar.address)
    check = subprocess.run([promtool, "check", "config", str(config)], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "prometheus.log", "wb") as log:
        server = subprocess.Popen(
            [require_binary("prometheus"), f"--config.file={config}",
             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
             "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
        try:
            query = f'{cat.COLLECTOR_UP.name}{{job="dataloader-exporter",collector="host"}}'
            result = _poll(url, query, timeout=30)
            assert result and scalar(result) == 1, _scrape_errors(url)
            assert scalar(_poll(url, 'up{job="dataloader-exporter"}', timeout=10)) == 1
        finally:
            server.terminate()
            server.wait(timeout=30)


def _scrape_errors(url: str) -> list[str]:
    targets = json.loads(http_get(f"{url}/api/v1/targets")[1])["data"]["activeTargets"]
    return [f"{t['scrapeUrl']}: {t['lastError']}" for t in targets]


def _poll(url: str, query: str, timeout: float) -> list[dict[str, Any]]:
    """An instant query's result once it is not empty; empty past the deadline."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            status, body = http_get(f"{url}/api/v1/query?" +
                                    urllib.parse.urlencode({"query": query}), timeout=2)
            if status == 200 and (result := json.loads(body)["data"]["result"]):
                return list(result)
        except OSError:
            pass  # not listening yet
        time.sleep(0.25)
    return []
