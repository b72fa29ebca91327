"""dcgm-exporter's GPU metrics, joined per pod where the sidecar runs without NVML.

In Kubernetes the sidecar requests no GPU, so it sees none and runs --no-collector.gpu;
NVIDIA's dcgm-exporter (a DaemonSet, usually from the GPU operator) reports every GPU of
the node, and with its Kubernetes mapping on (DCGM_EXPORTER_KUBERNETES=true, the kubelet's
pod-resources socket mounted) labels each GPU with the `namespace`, `pod` and `container`
it is allocated to. Its ServiceMonitor needs honorLabels: true, or Prometheus renames
those labels exported_pod and exported_namespace. The sidecar's series carry the same
`namespace` and `pod` (the PodMonitor adds them), which is the join.

The name below is dcgm-exporter's, not ours, so it is not in core.catalogue.
"""

from __future__ import annotations

from dataloader_exporter.core import catalogue as cat

from .promql import sel

# Share of time a kernel ran, in percent (0-100), per GPU.
GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
NAMES = (GPU_UTIL,)


def pod_utilization() -> str:
    """dcgm-exporter's utilization as a 0-1 ratio per GPU of a pod (unallocated GPUs,
    which carry no pod, left out)."""
    return f'{GPU_UTIL}{{pod!=""}} / 100'


def gpu_utilization(matchers: str) -> str:
    """dcgm-exporter's utilization as a 0-1 ratio per GPU, kept only for the pods whose
    sidecar serves series `matchers` selects (GPUs of other pods drop out)."""
    ours = sel(cat.BATCHES, matchers)
    return f'{GPU_UTIL}{{pod!=""}} / 100 and on (namespace, pod) {ours}'


def gpu_utilization_by_job() -> str:
    """Mean utilization of each job's GPUs as a 0-1 ratio, labelled (namespace, job) with
    the job of the pod's sidecar (dcgm-exporter's own `job` label is its scrape job's)."""
    pods = f"group by (namespace, pod, job) ({sel(cat.BATCHES)})"
    return (f'avg by (namespace, job) ({GPU_UTIL}{{pod!=""}} / 100 '
            f"* on (namespace, pod) group_left (job) {pods})")
