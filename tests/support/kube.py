"""Rendering the kustomizations under deploy/kubernetes offline and checking what the API
server would: strict schemas for built-in kinds and the prometheus-operator CRDs, and
the pod references a schema cannot see."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from dataloader_exporter.dashboards import kubernetes
from support.procs import REPO

K8S = REPO / "deploy" / "kubernetes"
OLDEST = "1.29"  # SidecarContainers on by default (beta) from 1.29
VERSIONS = (OLDEST, latest_version())
CRD_KINDS = ("PodMonitor", "PrometheusRule")
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


def kustomize(kubectl: str, directory: Path) -> list[dict[str, Any]]:
    result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True,
                            text=True, timeout=60)
    if result.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory}: {result.stderr}")
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def example_with_tls(kubectl: str, tmp_path_factory: pytest.TempPathFactory
                     ) -> list[dict[str, Any]]:
    """The example with the tls component, in a kustomization of one's own (the example's
    own sidecar component comes first, as in a components list)."""
    tmp = tmp_path_factory.mktemp("example-tls")
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(K8S / "example", tmp)],
        "components": [os.path.relpath(K8S / "tls", tmp)]}))
    return kustomize(kubectl, tmp)


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

