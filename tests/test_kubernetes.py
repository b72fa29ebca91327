"""Kubernetes, offline: every kustomization under deploy/kubernetes renders with kubectl's
built-in kustomize; built-in kinds validate strictly (unknown fields rejected) against
Kubernetes' published schemas (kubernetes-validate) for 1.29, the oldest release with
native sidecars on by default, and the newest it knows; the PodMonitor and PrometheusRules
against prometheus-operator's CRD schemas as the PyPI package
cloudcoil-models-prometheus-operator carries them (models generated from the operator's
CRDs, 0.80.1), made strict the same way. The
example agrees with the compose stack and with the generated rules and dashboards, and
broken copies are rejected, so the validation is known to bite. The tls component is
rendered after the sidecar component, in the example and on the workloads, and checked the
same way."""

from __future__ import annotations

import base64
import copy
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from conftest import require_binary
from kubernetes_validate.utils import latest_version

from dataloader_exporter.dashboards import build, kubernetes
from dataloader_exporter.dashboards.model import FOLDER

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "kubernetes"
IN_CI = os.environ.get("CI") == "true"
OLDEST = "1.29"  # SidecarContainers on by default (beta) from 1.29
VERSIONS = (OLDEST, latest_version())
CRD_KINDS = ("PodMonitor", "PrometheusRule")
WEB_CONFIG_ENV = "DATALOADER_EXPORTER_WEB_CONFIG_FILE"  # --web.config.file's variable
# Components that only make sense after others: rendered after them.
AFTER = {"tls": ("sidecar",)}
# A Job, a PyTorchJob with Master and Worker, and one with Workers only, for the component.
WORKLOADS = """
apiVersion: batch/v1
kind: Job
metadata: {name: mine}
spec:
  template:
    spec:
      restartPolicy: Never
      initContainers: [{name: fetch-data, image: busybox:1.36, command: ["true"]}]
      containers: [{name: trainer, image: my-trainer:1, env: [{name: SEED, value: "1"}]}]
      volumes: [{name: data, emptyDir: {}}]
---
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata: {name: ddp}
spec:
  pytorchReplicaSpecs:
    Master:
      replicas: 1
      template:
        spec:
          containers: [{name: pytorch, image: my-trainer:1}]
    Worker:
      replicas: 3
      template:
        spec:
          containers: [{name: pytorch, image: my-trainer:1}, {name: other, image: other:1}]
---
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata:
  name: elastic
  labels: {dataloader-exporter/worker-only: "true"}
spec:
  pytorchReplicaSpecs:
    Worker:
      replicas: 2
      template:
        spec:
          containers: [{name: pytorch, image: my-trainer:1}]
"""


@pytest.fixture(scope="module")
def kubectl() -> str:
    """kubectl (its built-in kustomize renders offline): skipped locally, a failure in CI."""
    path = shutil.which("kubectl")
    if path is None:
        msg = "kubectl not installed (it carries kustomize; no cluster is needed)"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def kustomize(kubectl: str, directory: Path) -> list[dict[str, Any]]:
    result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True,
                            text=True, timeout=60)
    if result.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory}: {result.stderr}")
    return [d for d in yaml.safe_load_all(result.stdout) if d]


@pytest.fixture(scope="module")
def example(kubectl: str) -> list[dict[str, Any]]:
    return kustomize(kubectl, K8S / "example")


@pytest.fixture(scope="module")
def example_tls(kubectl: str, tmp_path_factory: pytest.TempPathFactory
                ) -> list[dict[str, Any]]:
    """The example with the tls component, in a kustomization of one's own (the example's
    own sidecar component comes first, as in a components list)."""
    tmp = tmp_path_factory.mktemp("example-tls")
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(K8S / "example", tmp)],
        "components": [os.path.relpath(K8S / "tls", tmp)]}))
    return kustomize(kubectl, tmp)


@pytest.fixture(scope="module")
def workloads(kubectl: str, tmp_path_factory: pytest.TempPathFactory
              ) -> dict[str, dict[str, Any]]:
    """WORKLOADS with the component applied, by name."""
    return {d["metadata"]["name"]: d for d in with_component(kubectl, tmp_path_factory)}


@pytest.fixture(scope="module")
def workloads_tls(kubectl: str, tmp_path_factory: pytest.TempPathFactory
                  ) -> dict[str, dict[str, Any]]:
    """WORKLOADS with the sidecar and then the tls component applied, by name."""
    docs = with_component(kubectl, tmp_path_factory, K8S / "sidecar", K8S / "tls")
    return {d["metadata"]["name"]: d for d in docs}


def with_component(kubectl: str, tmp_path_factory: pytest.TempPathFactory,
                   *components: Path) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("component")
    (tmp / "workloads.yaml").write_text(WORKLOADS)
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": ["workloads.yaml"],
        "components": [os.path.relpath(c, tmp) for c in components or (K8S / "sidecar",)]}))
    return kustomize(kubectl, tmp)


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = by_kind(docs, kind)
    return doc


def named(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (item,) = [i for i in items if i["name"] == name]
    return item


def pod_spec(job: dict[str, Any]) -> dict[str, Any]:
    return dict(job["spec"]["template"]["spec"])


def sidecar(spec: dict[str, Any]) -> dict[str, Any]:
    return named(spec["initContainers"], kubernetes.CONTAINER)


# --- validation ---------------------------------------------------------------------------
def strict(schema: Any) -> Any:
    """A structural schema with unknown fields rejected wherever it lists properties and
    does not preserve unknown fields, as the API server's strict field validation does."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "$defs" in out:
        out["$defs"] = {k: strict(v) for k, v in out["$defs"].items()}
    if "properties" in out:
        out["properties"] = {k: strict(v) for k, v in out["properties"].items()}
        if ("additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [strict(s) for s in out[key]]
    return out


@cache
def crd_validator(kind: str) -> jsonschema.protocols.Validator:
    """The CRD's schema, from models generated from it (field names as the API spells them)."""
    from cloudcoil.models.prometheus_operator import v1

    schema = getattr(v1, kind).model_json_schema(by_alias=True, mode="validation")
    return jsonschema.Draft202012Validator(strict(schema))


def validate(doc: dict[str, Any], version: str) -> None:
    """Built-in kinds against Kubernetes' schema, the two CRDs against theirs; raises."""
    if doc["kind"] in CRD_KINDS:
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        crd_validator(doc["kind"]).validate(doc)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


def pod_template(spec: dict[str, Any]) -> dict[str, Any]:
    """A pod template from a custom resource (PyTorchJob), as a core/v1 PodTemplate."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
            "template": spec}


def reference_problems(spec: dict[str, Any]) -> list[str]:
    """What the API server's pod validation rejects that a schema cannot see: mounts of
    volumes that do not exist, duplicate names, probes on ports a container lacks."""
    problems = []
    volumes = [v["name"] for v in spec.get("volumes", [])]
    containers = spec.get("initContainers", []) + spec["containers"]
    names = [c["name"] for c in containers]
    for what, seen in (("volume", volumes), ("container", names)):
        problems += [f"duplicate {what} {n}" for n in set(seen) if seen.count(n) > 1]
    for c in containers:
        mounts = c.get("volumeMounts", [])
        problems += [f"{c['name']} mounts missing volume {m['name']}"
                     for m in mounts if m["name"] not in volumes]
        paths = [m["mountPath"] for m in mounts]
        problems += [f"{c['name']} mounts {p} twice" for p in set(paths) if paths.count(p) > 1]
        ports = {p.get("name") for p in c.get("ports", [])}
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            for handler in ("httpGet", "tcpSocket"):
                port = c.get(probe, {}).get(handler, {}).get("port")
                if isinstance(port, str) and port not in ports:
                    problems.append(f"{c['name']} {probe} on unknown port {port}")
    return problems


def pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for d in docs:
        if d["kind"] == "Job":
            yield d["metadata"]["name"], pod_spec(d)
        elif d["kind"] == "PyTorchJob":
            for replica, rs in d["spec"]["pytorchReplicaSpecs"].items():
                yield f"{d['metadata']['name']}/{replica}", rs["template"]["spec"]


# --- rendering and validation ---------------------------------------------------------------
def test_kubectl_kustomize_renders_every_kustomization_under_deploy_kubernetes(
        kubectl: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    found = sorted(p.parent for p in K8S.rglob("kustomization.yaml"))
    assert {p.relative_to(K8S).as_posix() for p in found} >= {"example", "monitoring",
                                                               "sidecar", "tls"}
    for directory in found:
        kind = yaml.safe_load((directory / "kustomization.yaml").read_text())["kind"]
        if kind == "Component":  # not buildable alone: applied to workloads, after others
            before = [K8S / name for name in AFTER.get(directory.name, ())]
            docs = with_component(kubectl, tmp_path_factory, *before, directory)
        else:
            assert kind == "Kustomization", directory
            docs = kustomize(kubectl, directory)
        assert docs, directory


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_strictly_against_kubernetes_and_the_crd_schemas(
        version: str, example: list[dict[str, Any]],
        workloads: dict[str, dict[str, Any]]) -> None:
    kinds = sorted(d["kind"] for d in example)
    assert kinds == ["ConfigMap"] * len(build.BOARDS) + [
        "Job", "Namespace", "PodMonitor", "PrometheusRule", "PrometheusRule", "Service"]
    for doc in example:
        validate(doc, version)
    validate(workloads["mine"], version)
    for name, spec in pod_specs([workloads["ddp"], workloads["elastic"]]):
        assert name  # the custom resource itself has no schema here; its pod templates do
        validate(pod_template({"metadata": {}, "spec": spec}), version)


def test_every_pod_passes_the_api_servers_reference_checks(
        example: list[dict[str, Any]], workloads: dict[str, dict[str, Any]]) -> None:
    specs = list(pod_specs(example)) + list(pod_specs(list(workloads.values())))
    assert len(specs) == 5
    for name, spec in specs:
        assert reference_problems(spec) == [], name


# --- what the example says ------------------------------------------------------------------
def compose_exporter() -> dict[str, Any]:
    return dict(yaml.safe_load((REPO / "docker-compose.yml").read_text())
                ["services"]["exporter"])


def test_the_sidecar_is_native_with_the_compose_exporters_image_flags_and_port(
        example: list[dict[str, Any]]) -> None:
    spec = pod_spec(one(example, "Job"))
    side = sidecar(spec)
    assert side["restartPolicy"] == "Always"  # native: the Job completes with the trainer
    assert kubernetes.CONTAINER not in [c["name"] for c in spec["containers"]]
    exporter = compose_exporter()
    assert side["image"] == exporter["image"]
    assert side["args"] == exporter["command"]
    (port,) = side["ports"]
    compose_port = int(str(exporter["ports"][0]).rsplit(":", 1)[1])
    assert port["containerPort"] == compose_port == kubernetes.PORT
    assert f"--web.listen-address=:{port['containerPort']}" in side["args"]
    assert "--no-collector.gpu" in side["args"]  # no GPU of its own: dcgm-exporter's
    assert not [r for part in side["resources"].values() for r in part if "gpu" in r]


def test_trainer_and_sidecar_share_the_snapshot_dir_and_a_sized_dev_shm(
        example: list[dict[str, Any]]) -> None:
    spec = pod_spec(one(example, "Job"))
    trainer, side = named(spec["containers"], "trainer"), sidecar(spec)
    volumes = {v["name"]: v for v in spec["volumes"]}
    env = {e["name"]: e["value"] for e in trainer["env"]}
    snapshots = named(trainer["volumeMounts"], kubernetes.SNAPSHOTS)
    assert snapshots["mountPath"] == env["DATALOADER_EXPORTER_DIR"] == kubernetes.METRICS_DIR
    assert not snapshots.get("readOnly")
    assert not named(side["volumeMounts"], kubernetes.SNAPSHOTS).get("readOnly")  # it deletes
    assert f"--metrics-dir={snapshots['mountPath']}" in side["args"]
    for c in (trainer, side):
        assert named(c["volumeMounts"], kubernetes.SHM)["mountPath"] == "/dev/shm"
    shm = volumes[kubernetes.SHM]["emptyDir"]
    assert shm["medium"] == "Memory" and shm["sizeLimit"]
    assert volumes[kubernetes.SNAPSHOTS]["emptyDir"]["sizeLimit"]


def test_the_sidecar_is_probed_sized_and_hardened(example: list[dict[str, Any]]) -> None:
    side = sidecar(pod_spec(one(example, "Job")))
    for probe in ("readinessProbe", "livenessProbe"):
        assert side[probe]["httpGet"] == {"path": "/-/healthy", "port": kubernetes.PORT_NAME}
    assert side["ports"][0]["name"] == kubernetes.PORT_NAME
    assert set(side["resources"]["requests"]) == {"cpu", "memory"}
    assert set(side["resources"]["limits"]) == {"memory"}
    assert side["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
        "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
        "privileged": False, "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"}}
    assert "USER 10001" in (REPO / "Dockerfile").read_text()


@pytest.mark.parametrize(("rendered", "volume_kinds"), [
    ("example", {"emptyDir"}), ("example_tls", {"emptyDir", "secret"})])
def test_the_example_pod_meets_the_restricted_pod_security_standard(
        rendered: str, volume_kinds: set[str], request: pytest.FixtureRequest) -> None:
    """The checks of the `restricted` profile its namespace enforces: no root, no
    privilege escalation, no capabilities, the runtime's seccomp profile, only emptyDirs
    (and with the tls component, the Secret)."""
    example = request.getfixturevalue(rendered)
    namespace = one(example, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == \
        "restricted"
    spec = pod_spec(one(example, "Job"))
    pod = spec.get("securityContext", {})
    for c in spec["initContainers"] + spec["containers"]:
        ctx = c.get("securityContext", {})
        assert ctx.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, c["name"]
        assert ctx.get("runAsUser", pod.get("runAsUser")) != 0, c["name"]
        assert ctx["allowPrivilegeEscalation"] is False and not ctx.get("privileged")
        assert ctx["capabilities"] == {"drop": ["ALL"]}, c["name"]
        seccomp = ctx.get("seccompProfile", pod.get("seccompProfile"))
        assert seccomp == {"type": "RuntimeDefault"}, c["name"]
    assert {kind for v in spec["volumes"] for kind in v if kind != "name"} == volume_kinds


def test_the_pod_monitor_scrapes_the_sidecars_port_on_the_pods_the_component_labels(
        example: list[dict[str, Any]]) -> None:
    monitor, job = one(example, "PodMonitor"), one(example, "Job")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == sidecar(pod_spec(job))["ports"][0]["name"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    (relabel,) = endpoint["relabelings"]
    assert relabel["targetLabel"] == "job"  # the training job's name, from pod labels
    assert relabel["sourceLabels"][-2:] == [
        "__meta_kubernetes_pod_label_batch_kubernetes_io_job_name",
        "__meta_kubernetes_pod_label_job_name"]


def test_the_prometheus_rules_are_the_rule_files_groups_unchanged(
        example: list[dict[str, Any]]) -> None:
    rules = {r["metadata"]["name"]: r["spec"]["groups"] for r in by_kind(example,
                                                                          "PrometheusRule")}
    committed = REPO / "deploy" / "prometheus"
    assert rules == {
        "dataloader-exporter-alerts": yaml.safe_load(
            (committed / "rules.yml").read_text())["groups"],
        "dataloader-exporter-recording": yaml.safe_load(
            (committed / "recording.yml").read_text())["groups"]}


def test_the_dashboard_config_maps_are_the_generated_json_for_grafanas_sidecar(
        example: list[dict[str, Any]]) -> None:
    generated = build.files()
    maps = by_kind(example, "ConfigMap")
    assert len(maps) == len(build.BOARDS)
    seen = set()
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"]["grafana_folder"] == FOLDER
        ((name, text),) = cm["data"].items()
        assert text == generated[f"grafana/dashboards/{name}"]
        assert text == (REPO / "deploy" / "grafana" / "dashboards" / name).read_text()
        seen.add(name)
    assert seen == {f"{b.uid}.json" for b in build.BOARDS}


def test_the_example_is_an_indexed_torchrun_job_with_its_headless_service(
        example: list[dict[str, Any]]) -> None:
    job, service = one(example, "Job"), one(example, "Service")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"] == 2
    pod = pod_spec(job)
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name":
                                           job["metadata"]["name"]}
    assert service["metadata"]["namespace"] == job["metadata"]["namespace"]
    trainer = named(pod["containers"], "trainer")
    assert trainer["command"] == ["torchrun"]
    args = dict(a.split("=", 1) for a in trainer["args"] if a.startswith("--") and "=" in a)
    assert args["--nnodes"] == str(spec["completions"])
    assert args["--node-rank"] == "$(JOB_COMPLETION_INDEX)"
    name, svc = job["metadata"]["name"], service["metadata"]["name"]
    assert args["--master-addr"] == f"{name}-0.{svc}"
    assert int(args["--master-port"]) == service["spec"]["ports"][0]["port"] == \
        named(trainer["ports"], "rendezvous")["containerPort"]
    # The first matching rule decides: an evicted trainer (non-zero exit after SIGTERM) must
    # meet the Ignore rule for disruptions before the rule that fails the Job.
    actions = [r["action"] for r in spec["podFailurePolicy"]["rules"]]
    assert actions.index("Ignore") < actions.index("FailJob")
    ignore = spec["podFailurePolicy"]["rules"][actions.index("Ignore")]
    assert ignore["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]


def test_the_component_patches_pytorchjob_replicas_and_keeps_what_is_there(
        workloads: dict[str, dict[str, Any]]) -> None:
    mine = pod_spec(workloads["mine"])
    assert [c["name"] for c in mine["initContainers"]] == [kubernetes.CONTAINER, "fetch-data"]
    assert {v["name"] for v in mine["volumes"]} == {"data", kubernetes.SNAPSHOTS,
                                                    kubernetes.SHM}
    trainer = named(mine["containers"], "trainer")
    assert trainer["image"] == "my-trainer:1" and len(trainer["env"]) == 2
    replicas = workloads["ddp"]["spec"]["pytorchReplicaSpecs"]
    for replica in ("Master", "Worker"):
        spec = replicas[replica]["template"]["spec"]
        assert sidecar(spec) == sidecar(mine)
        pytorch = named(spec["containers"], "pytorch")
        assert pytorch["image"] == "my-trainer:1"  # merged by name, not replaced
        assert {m["name"] for m in pytorch["volumeMounts"]} == {kubernetes.SNAPSHOTS,
                                                               kubernetes.SHM}
    assert [c["name"] for c in replicas["Worker"]["template"]["spec"]["containers"]] == [
        "pytorch", "other"]
    assert replicas["Master"]["replicas"] == 1
    assert set(workloads["elastic"]["spec"]["pytorchReplicaSpecs"]) == {"Worker"}


# --- the tls component -----------------------------------------------------------------------
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


# --- the validation bites -------------------------------------------------------------------
def _typo_in_the_sidecar(docs: list[dict[str, Any]]) -> dict[str, Any]:
    job = copy.deepcopy(one(docs, "Job"))
    side = sidecar(pod_spec(job))
    side["restartPolicyy"] = side.pop("restartPolicy")
    return job


def _sidecar_port_as_text(docs: list[dict[str, Any]]) -> dict[str, Any]:
    job = copy.deepcopy(one(docs, "Job"))
    sidecar(pod_spec(job))["ports"][0]["containerPort"] = "9478"
    return job


def _typo_in_the_pod_monitor(docs: list[dict[str, Any]]) -> dict[str, Any]:
    monitor = copy.deepcopy(one(docs, "PodMonitor"))
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    endpoint["intervall"] = endpoint.pop("interval")
    return monitor


def _pod_monitor_without_selector(docs: list[dict[str, Any]]) -> dict[str, Any]:
    monitor = copy.deepcopy(one(docs, "PodMonitor"))
    del monitor["spec"]["selector"]
    return monitor


def _typo_in_a_rule(docs: list[dict[str, Any]]) -> dict[str, Any]:
    rule = copy.deepcopy(by_kind(docs, "PrometheusRule")[0])
    first = rule["spec"]["groups"][0]["rules"][0]
    first["exp"] = first.pop("expr")
    return rule


@pytest.mark.parametrize("broken", [_typo_in_the_sidecar, _sidecar_port_as_text,
                                    _typo_in_the_pod_monitor, _pod_monitor_without_selector,
                                    _typo_in_a_rule])
def test_a_broken_copy_fails_schema_validation(
        broken: Callable[[list[dict[str, Any]]], dict[str, Any]],
        example: list[dict[str, Any]]) -> None:
    doc = broken(example)
    for version in VERSIONS:
        with pytest.raises(jsonschema.ValidationError):
            validate(doc, version)


def test_a_pod_missing_a_volume_fails_the_reference_checks(
        example: list[dict[str, Any]]) -> None:
    spec = copy.deepcopy(pod_spec(one(example, "Job")))
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != kubernetes.SHM]
    assert reference_problems(spec) == [
        f"{kubernetes.CONTAINER} mounts missing volume {kubernetes.SHM}",
        f"trainer mounts missing volume {kubernetes.SHM}"]
    side = sidecar(spec)
    side["readinessProbe"]["httpGet"]["port"] = "metrics"
    assert f"{kubernetes.CONTAINER} readinessProbe on unknown port metrics" in \
        reference_problems(spec)


def test_a_kustomization_with_a_broken_patch_fails_to_render(
        kubectl: str, tmp_path: Path) -> None:
    component = tmp_path / "sidecar"
    shutil.copytree(K8S / "sidecar", component)
    assert with_component_at(kubectl, component)  # the copy renders as it is
    patch = component / "job.yaml"
    patch.write_text(patch.read_text().replace("apiVersion: batch/v1", "apiVersion: [batch/v1"))
    with pytest.raises(AssertionError, match=r"kubectl kustomize .*job\.yaml"):
        with_component_at(kubectl, component)


def with_component_at(kubectl: str, component: Path) -> list[dict[str, Any]]:
    """WORKLOADS with the component at `component`, from a kustomization beside it (one
    inside it would be a cycle kustomize refuses, whatever the component holds)."""
    app = component.parent / "app"
    app.mkdir(exist_ok=True)
    (app / "workloads.yaml").write_text(WORKLOADS)
    (app / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": ["workloads.yaml"], "components": [f"../{component.name}"]}))
    return kustomize(kubectl, app)
