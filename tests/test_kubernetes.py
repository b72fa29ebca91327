"""Kubernetes, offline: every kustomization under deploy/kubernetes renders with kubectl's
built-in kustomize; built-in kinds validate strictly (unknown fields rejected) against
Kubernetes' published schemas (kubernetes-validate) for 1.29, the oldest release with
native sidecars on by default, and the newest it knows; the PodMonitor and PrometheusRules
against prometheus-operator's CRD schemas as the PyPI package
cloudcoil-models-prometheus-operator carries them (models generated from the operator's
CRDs, 0.80.1), made strict the same way. The
example agrees with the compose stack and with the generated rules and dashboards, and
broken copies are rejected, so the validation is known to bite. The tls component:
test_kubernetes_tls.py."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from support.kube import (
    AFTER,
    K8S,
    VERSIONS,
    WORKLOADS,
    by_kind,
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

from dataloader_exporter.dashboards import build, kubernetes
from dataloader_exporter.dashboards.model import FOLDER


@pytest.fixture(scope="module")
def workloads(kubectl: str, tmp_path_factory: pytest.TempPathFactory
              ) -> dict[str, dict[str, Any]]:
    """WORKLOADS with the component applied, by name."""
    return {d["metadata"]["name"]: d for d in with_component(kubectl, tmp_path_factory)}


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


@pytest.mark.slow
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
