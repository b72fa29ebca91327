"""Kubernetes, offline, with the tls component: rendered after the sidecar component, in
the example and on the workloads, it validates strictly like the rest, gives the sidecar
its web config from a Secret, makes the PodMonitor scrape over https with basic auth,
and the kubectl commands its comments show make the Secrets the objects read."""

from __future__ import annotations

import base64
import copy
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from support.kube import (
    K8S,
    VERSIONS,
    kustomize,
    named,
    one,
    pod_spec,
    pod_specs,
    pod_template,
    reference_problems,
    sidecar,
    validate,
    with_component,
)
from support.procs import REPO
from support.required import require_binary

from dataloader_exporter.dashboards import kubernetes

WEB_CONFIG_ENV = "DATALOADER_EXPORTER_WEB_CONFIG_FILE"  # --web.config.file's variable


@pytest.fixture(scope="module")
def workloads_tls(kubectl: str, tmp_path_factory: pytest.TempPathFactory
                  ) -> dict[str, dict[str, Any]]:
    """WORKLOADS with the sidecar and then the tls component applied, by name."""
    docs = with_component(kubectl, tmp_path_factory, K8S / "sidecar", K8S / "tls")
    return {d["metadata"]["name"]: d for d in docs}


def compose_web_config() -> Path:
    """Where docker-compose.tls.yml points the exporter's --web.config.file."""
    override = yaml.safe_load((REPO / "docker-compose.tls.yml").read_text())
    return Path(override["services"]["exporter"]["environment"][WEB_CONFIG_ENV])


@pytest.mark.parametrize("version", VERSIONS)
def test_with_the_tls_component_every_object_still_validates_strictly(
        version: str, example: list[dict[str, Any]], example_tls: list[dict[str, Any]],
        workloads_tls: dict[str, dict[str, Any]]) -> None:
    assert sorted(d["kind"] for d in example_tls) == sorted(d["kind"] for d in example)
    for doc in example_tls:
        validate(doc, version)
    validate(workloads_tls["mine"], version)
    for name, spec in pod_specs([workloads_tls["ddp"], workloads_tls["elastic"]]):
        assert name
        validate(pod_template({"metadata": {}, "spec": spec}), version)
    specs = list(pod_specs(example_tls)) + list(pod_specs(list(workloads_tls.values())))
    assert len(specs) == 5
    for name, spec in specs:
        assert reference_problems(spec) == [], name


def test_the_tls_component_gives_the_sidecar_its_web_config_from_the_secret_and_tcp_probes(
        example: list[dict[str, Any]], example_tls: list[dict[str, Any]]) -> None:
    plain, tls = sidecar(pod_spec(one(example, "Job"))), sidecar(pod_spec(one(example_tls,
                                                                              "Job")))
    web_config = compose_web_config()  # the same path as in the compose stack
    assert tls["args"] == [*plain["args"], f"--web.config.file={web_config}"]
    (mount,) = [m for m in tls["volumeMounts"] if m not in plain["volumeMounts"]]
    assert mount["mountPath"] == str(web_config.parent) and mount["readOnly"] is True
    volumes = {v["name"]: v for v in pod_spec(one(example_tls, "Job"))["volumes"]}
    secret = volumes[mount["name"]]["secret"]
    assert secret["secretName"] == kubernetes.WEB_SECRET
    # The web config and the files it names beside it (make-certs.sh writes them so).
    assert [(i["key"], i["path"]) for i in secret["items"]] == [
        (web_config.name, web_config.name), ("tls.crt", "tls.crt"), ("tls.key", "tls.key")]
    for probe in ("readinessProbe", "livenessProbe"):  # every HTTP path needs the password
        assert tls[probe] == {**{k: v for k, v in plain[probe].items() if k != "httpGet"},
                              "tcpSocket": {"port": kubernetes.PORT_NAME}}
    changed = ("args", "readinessProbe", "livenessProbe", "volumeMounts")
    assert {k: v for k, v in tls.items() if k not in changed} == \
        {k: v for k, v in plain.items() if k not in changed}
    trainer = named(pod_spec(one(example, "Job"))["containers"], "trainer")
    assert named(pod_spec(one(example_tls, "Job"))["containers"], "trainer") == trainer


def test_the_tls_component_patches_pytorchjob_replicas_and_keeps_what_is_there(
        example_tls: list[dict[str, Any]], workloads_tls: dict[str, dict[str, Any]]) -> None:
    expected = sidecar(pod_spec(one(example_tls, "Job")))
    specs = dict(pod_specs(list(workloads_tls.values())))
    assert set(specs) == {"mine", "ddp/Master", "ddp/Worker", "elastic/Worker"}
    for name, spec in specs.items():
        assert sidecar(spec) == expected, name
        assert kubernetes.WEB_SECRET in {v["name"] for v in spec["volumes"]}, name
    assert [c["name"] for c in specs["mine"]["initContainers"]] == [kubernetes.CONTAINER,
                                                                    "fetch-data"]
    assert {v["name"] for v in specs["mine"]["volumes"]} == {
        "data", kubernetes.SNAPSHOTS, kubernetes.SHM, kubernetes.WEB_SECRET}
    assert [c["name"] for c in specs["ddp/Worker"]["containers"]] == ["pytorch", "other"]
    assert set(workloads_tls["elastic"]["spec"]["pytorchReplicaSpecs"]) == {"Worker"}


def test_with_tls_the_pod_monitor_scrapes_https_with_ca_and_basic_auth_from_one_secret(
        example: list[dict[str, Any]], example_tls: list[dict[str, Any]]) -> None:
    plain, monitor = one(example, "PodMonitor"), copy.deepcopy(one(example_tls, "PodMonitor"))
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    secret = kubernetes.SCRAPE_SECRET
    assert endpoint.pop("scheme") == "https"
    # Pod IPs are in no certificate: the name checked is one make-certs.sh puts there.
    assert endpoint.pop("tlsConfig") == {"ca": {"secret": {"name": secret, "key": "ca.crt"}},
                                         "serverName": "dataloader-exporter"}
    assert endpoint.pop("basicAuth") == {"username": {"name": secret, "key": "username"},
                                         "password": {"name": secret, "key": "password"}}
    assert monitor == plain  # nothing else changed


def _documented_commands() -> list[list[str]]:
    """The kubectl commands the tls component's comments show, continuation lines joined."""
    lines = (K8S / "tls" / "kustomization.yaml").read_text().splitlines()
    text = "\n".join(line[1:].strip() for line in lines if line.startswith("#"))
    return [shlex.split(line) for line in text.replace("\\\n", " ").splitlines()
            if line.startswith("kubectl ")]


def test_the_documented_kubectl_commands_make_the_secrets_the_objects_read(
        kubectl: str, tmp_path: Path) -> None:
    """Run offline (--dry-run=client) on make-certs.sh's real output."""
    require_binary("openssl")
    made = subprocess.run(["sh", str(REPO / "deploy" / "tls" / "make-certs.sh"),
                           str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable})
    assert made.returncode == 0, made.stderr
    secrets = {}
    commands = _documented_commands()
    assert len(commands) == 2
    for command in commands:
        args = [a.replace("deploy/tls/", f"{tmp_path}/").replace("NAMESPACE", "dataloader-example")
                for a in command[1:]]
        result = subprocess.run([kubectl, *args, "--dry-run=client", "-o", "yaml"],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        doc = yaml.safe_load(result.stdout)
        secrets[doc["metadata"]["name"]] = (doc["metadata"]["namespace"], {
            k: base64.b64decode(v) for k, v in doc["data"].items()})
    _, web = secrets[kubernetes.WEB_SECRET]  # in NAMESPACE, the Job's
    assert web == {k: (tmp_path / k).read_bytes() for k in kubernetes.WEB_KEYS}
    scrape_ns, scrape = secrets[kubernetes.SCRAPE_SECRET]
    monitoring = yaml.safe_load((K8S / "monitoring" / "kustomization.yaml").read_text())
    assert scrape_ns == monitoring["namespace"]  # the PodMonitor's: the operator reads there
    assert scrape == {"ca.crt": (tmp_path / "ca.crt").read_bytes(), "username": b"prometheus",
                      "password": (tmp_path / "prometheus-password").read_bytes()}
    assert set(scrape) == set(kubernetes.SCRAPE_KEYS)
    users = yaml.safe_load(web["web-config.yml"])["basic_auth_users"]
    assert set(users) == {scrape["username"].decode()}


def _tls_secret_key_missing(docs: list[dict[str, Any]]) -> dict[str, Any]:
    monitor = copy.deepcopy(one(docs, "PodMonitor"))
    del monitor["spec"]["podMetricsEndpoints"][0]["basicAuth"]["password"]["key"]
    return monitor


def _tls_typo_in_the_tls_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    monitor = copy.deepcopy(one(docs, "PodMonitor"))
    tls = monitor["spec"]["podMetricsEndpoints"][0]["tlsConfig"]
    tls["servername"] = tls.pop("serverName")
    return monitor


def _tls_secret_volume_typo(docs: list[dict[str, Any]]) -> dict[str, Any]:
    job = copy.deepcopy(one(docs, "Job"))
    (web,) = [v for v in pod_spec(job)["volumes"] if "secret" in v]
    web["secret"]["secret_name"] = web["secret"].pop("secretName")
    return job


@pytest.mark.parametrize("broken", [_tls_secret_key_missing, _tls_typo_in_the_tls_config,
                                    _tls_secret_volume_typo])
def test_a_broken_copy_of_the_tls_objects_fails_schema_validation(
        broken: Callable[[list[dict[str, Any]]], dict[str, Any]],
        example_tls: list[dict[str, Any]]) -> None:
    doc = broken(example_tls)
    for version in VERSIONS:
        with pytest.raises(jsonschema.ValidationError):
            validate(doc, version)


def test_the_tls_component_refuses_a_pod_monitor_whose_first_endpoint_is_another(
        kubectl: str, tmp_path: Path) -> None:
    """Its JSON patch tests the port first, rather than change someone else's endpoint."""
    shutil.copytree(K8S / "tls", tmp_path / "tls")
    app = tmp_path / "app"
    app.mkdir()
    (app / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": ["monitor.yaml"], "components": ["../tls"]}))
    monitor = kubernetes.pod_monitor()
    (app / "monitor.yaml").write_text(yaml.safe_dump(monitor))
    (rendered,) = kustomize(kubectl, app)
    assert rendered["spec"]["podMetricsEndpoints"][0]["scheme"] == "https"
    monitor["spec"]["podMetricsEndpoints"].insert(0, {"port": "metrics", "path": "/metrics"})
    (app / "monitor.yaml").write_text(yaml.safe_dump(monitor))
    with pytest.raises(AssertionError, match="podMetricsEndpoints/0/port failed"):
        kustomize(kubectl, app)

