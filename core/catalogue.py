"""The metric catalogue: every metric this project exports, as data.

Standard library only. Instrumentation, collectors, dashboards, alerts, the docs'
metric table and the tests read names, types, help, units, labels and buckets from here, so
no metric name is typed as a string literal anywhere else (like dcgm-exporter's
counters file).
"""

from __future__ import annotations

from dataclasses import dataclass

COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"

TRAINER = "trainer"
GPU = "gpu"
SHM = "shm"
HOST = "host"
SELF = "exporter"

# Each layout keeps the boundaries something reads (dashboards, alerts and their promtool
# cases, the doctor, the loader tuner) and no others: every boundary is a series per
# (loader, rank), and at 10,000 ranks every series is 10,000 of them.
# Waiting for a batch: from a prefetched batch (under 100 us) to a starved loader (10 s);
# steps of 2-2.5x where the doctor's and the dashboards' quantiles and the loader tuner's
# burstiness (p95 over the median, at 4x and above) are read, and le="0.01" the alerts'
# cases use. A longer wait reads as 10 s: the loader starves either way.
WAIT_BUCKETS: tuple[float, ...] = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                   0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
# A training step, read only as a p95 on the overview dashboard (the rest reads _sum):
# decades, 1 ms (tiny models) to 10 s; within a decade the p95 interpolates, the mean exact.
STEP_BUCKETS: tuple[float, ...] = (0.001, 0.01, 0.1, 1.0, 10.0)
# Steps binned in process (older trainers' exported layout): the decades and the 3x steps
# between them, as the loader tuner reads a step over its 3 s window as a pause.
STEP_BINS: tuple[float, ...] = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
# Copying a batch host to device (to_device), read only as a p95 beside its mean (the
# overview dashboard; the doctor and the bandwidth panel read _sum): decades from 0.5 ms (a
# small batch, or a pinned one) to 50 ms (a large pageable one, which stalls most steps).
# A longer copy reads as 50 ms; within a decade the p95 is an interpolation, the mean exact.
TRANSFER_BUCKETS: tuple[float, ...] = (0.0005, 0.005, 0.05)
# The first batch of an epoch is read only as a mean (_sum / _count: dashboards, alerts,
# the doctor), so its histogram has the +Inf bucket alone.
FIRST_BATCH_BUCKETS: tuple[float, ...] = ()

LOADER_LABELS: tuple[str, ...] = ("loader", "rank")
PROCESS_LABELS: tuple[str, ...] = ("rank",)  # a fact about the training process, not a loader
WORKER_LABELS: tuple[str, ...] = ("loader", "rank", "worker")
INFO_LABELS: tuple[str, ...] = (
    "loader", "rank", "num_workers", "batch_size", "prefetch_factor", "pin_memory",
    "persistent_workers", "gpu_uuid", "dev_shm_bytes",
)
PHASE_FETCH = "fetch"
PHASE_TRANSFER = "transfer"
# dataloader_time_seconds' bucket layout by phase (Metric.buckets: the fetch phase's).
PHASE_BUCKETS: dict[str, tuple[float, ...]] = {
    PHASE_FETCH: WAIT_BUCKETS, PHASE_TRANSFER: TRANSFER_BUCKETS}


@dataclass(frozen=True)
class Metric:
    """One exported metric: the full sample name as scraped (counters end in _total)."""

    name: str
    type: str
    help: str
    unit: str
    labels: tuple[str, ...]
    source: str
    buckets: tuple[float, ...] = ()

    @property
    def family(self) -> str:
        """The name prometheus_client's metric families take (counters without _total)."""
        if self.type == COUNTER and self.name.endswith("_total"):
            return self.name[: -len("_total")]
        return self.name


_m = Metric  # positionally: name, type, help, unit, labels, source, buckets


# --- trainer: written by instrument/ into snapshot files or served in-process ----------
TIME = _m(
    "dataloader_time_seconds", HISTOGRAM,
    "Time the training loop was blocked waiting for the next batch (phase=fetch) or "
    "copying it host to device through to_device (phase=transfer); each phase absent "
    "until it is first timed.",
    "seconds", (*LOADER_LABELS, "phase"), TRAINER, WAIT_BUCKETS)
STEP = _m(
    "dataloader_step_seconds", HISTOGRAM,
    "Time between batches spent outside the loader, that is the training step; absent "
    "until a second batch.",
    "seconds", LOADER_LABELS, TRAINER, STEP_BUCKETS)
BATCHES = _m(
    "dataloader_batches_total", COUNTER,
    "Batches the loader has handed to the training loop.",
    "", LOADER_LABELS, TRAINER)
SAMPLES = _m(
    "dataloader_samples_total", COUNTER,
    "Samples in the batches the loader has handed to the training loop; absent when "
    "they cannot be counted.",
    "", LOADER_LABELS, TRAINER)
EPOCHS = _m(
    "dataloader_epochs_total", COUNTER,
    "Epochs started: iterators over the loader that handed out a first batch (an iter() "
    "that fetches nothing, a framework's probe, is not an epoch).",
    "", LOADER_LABELS, TRAINER)
FIRST_BATCH = _m(
    "dataloader_first_batch_seconds", HISTOGRAM,
    "Time from the start of an epoch (iter) to its first batch: the epoch-start stall; "
    "absent until an epoch's first batch.",
    "seconds", LOADER_LABELS, TRAINER, FIRST_BATCH_BUCKETS)
LAST_BATCH = _m(
    "dataloader_last_batch_timestamp_seconds", GAUGE,
    "Unix time at which the loader last handed out a batch, for hang detection.",
    "seconds", LOADER_LABELS, TRAINER)
EXITED = _m(
    "dataloader_exit_timestamp_seconds", GAUGE,
    "Unix time at which the training process exited normally (its exit handlers ran and "
    "wrote this, its last snapshot); absent while it runs, and after a kill or a crash "
    "that ran no exit handler.",
    "seconds", PROCESS_LABELS, TRAINER)
WORKERS_CONFIGURED = _m(
    "dataloader_workers_configured", GAUGE,
    "Worker processes the loader is configured with (num_workers).",
    "", LOADER_LABELS, TRAINER)
WORKERS_ACTIVE = _m(
    "dataloader_workers_active", GAUGE,
    "Worker processes of the loader that are alive now, refreshed at most once a second.",
    "", LOADER_LABELS, TRAINER)
WORKERS_LOST = _m(
    "dataloader_workers_lost_total", COUNTER,
    "Worker processes that died while the loader still needed them (killed, crashed).",
    "", LOADER_LABELS, TRAINER)
# CPU time, not wall time: a worker's wait for I/O cannot be timed without wrapping the
# dataset, which torch and users inspect (instrument/hotpath/workerblock.py), so it is not guessed.
WORKER_CPU = _m(
    "dataloader_worker_cpu_seconds_total", COUNTER,
    "CPU time (user and system) each worker process has used, start-up included, as of "
    "its latest batch.",
    "seconds", WORKER_LABELS, TRAINER)
WORKER_SAMPLES = _m(
    "dataloader_worker_samples_total", COUNTER,
    "Samples each worker process has produced; absent for a worker whose batches cannot "
    "be counted.",
    "", WORKER_LABELS, TRAINER)
LOOP_CPU = _m(
    "dataloader_loop_cpu_seconds_total", COUNTER,
    "CPU time of the thread that iterates the loader, while it hands out batches with no "
    "worker alive (its fetches, made in that thread, and the steps between them), read "
    "about once a second; absent until such a stretch was read.",
    "seconds", LOADER_LABELS, TRAINER)
BATCH_BYTES = _m(
    "dataloader_batch_bytes", GAUGE,
    "Tensor bytes in a recent batch (sampled); feeds the /dev/shm preflight.",
    "bytes", LOADER_LABELS, TRAINER)
TRANSFER_BYTES = _m(
    "dataloader_transfer_bytes_total", COUNTER,
    "Tensor bytes moved host to device by to_device; absent until to_device moved a batch.",
    "bytes", LOADER_LABELS, TRAINER)
# The loader tuner (opt-in, core/tuner/rules.py): present only for a loader being tuned.
TUNER_CHANGES = _m(
    "dataloader_tuner_changes_total", COUNTER,
    "Changes the loader tuner made to a setting (num_workers, prefetch_factor, "
    "persistent_workers), by reason (starved, cpu-contention, cores, memory, bursty, "
    "reverted, epoch-start, dataset-changed); each pair the tuner can make for the settings "
    "it tunes starts at 0.",
    "", (*LOADER_LABELS, "setting", "reason"), TRAINER)
TUNER_STABLE = _m(
    "dataloader_tuner_stable", GAUGE,
    "Whether the loader tuner has settled on its settings (settings: those it tunes, "
    "comma-separated): 1 once stable, 0 while it still tries changes; absent for a loader "
    "that is not tuned, or whose tuner only advises or has stopped.",
    "", (*LOADER_LABELS, "settings"), TRAINER)
INFO = _m(
    "dataloader_info", GAUGE,
    "The loader's effective configuration, the UUID of the GPU its batches go to (empty "
    "until one goes to CUDA) and the size of the /dev/shm its workers hand batches over "
    "through (empty if unknown); the value is always 1.",
    "", INFO_LABELS, TRAINER)

# Where a worker's time goes, read from /proc/<pid> about once a second (Linux only; where
# it cannot be read nothing is exported). Summed over a loader's workers, so that a rank
# with 16 workers has as many series as one with 2; the per-worker series above keep the
# detail that names one slow worker, and WORKER_MAX_RSS one growing one.
WORKER_STATES: tuple[str, ...] = ("running", "waiting_for_cpu", "blocked")
WORKER_TIME = _m(
    "dataloader_worker_time_seconds_total", COUNTER,
    "Wall time of the loader's worker processes while the loader hands out batches, "
    "summed over workers, by state: running on a CPU, waiting for a CPU (runnable, in the "
    "run queue; on a virtual machine, also the time the hypervisor held its CPU, estimated "
    "from the machine's steal), or blocked (the rest: storage, the network, a lock, a full "
    "queue or sleep).",
    "seconds", (*LOADER_LABELS, "state"), TRAINER)
READ_SOURCES: tuple[str, ...] = ("storage", "syscalls")
WORKER_READ = _m(
    "dataloader_worker_read_bytes_total", COUNTER,
    "Bytes the loader's workers read while it hands out batches, summed over workers: from "
    "storage (source=storage) or through read system calls of any kind, page cache and "
    "network included (source=syscalls).",
    "bytes", (*LOADER_LABELS, "source"), TRAINER)
WORKER_MAJOR_FAULTS = _m(
    "dataloader_worker_major_page_faults_total", COUNTER,
    "Major page faults of the loader's workers while it hands out batches (pages read back "
    "from disk or swap), summed over workers.",
    "", LOADER_LABELS, TRAINER)
MEMORY_KINDS: tuple[str, ...] = ("rss", "pss", "swap", "available")
WORKER_MEMORY = _m(
    "dataloader_worker_memory_bytes", GAUGE,
    "Memory of the loader's live workers, summed over workers: proportional (kind=pss; "
    "shared pages divided among their sharers, read as often as it stays cheap), "
    "resident instead where PSS cannot be read (kind=rss; pages shared with the main "
    "process count in every worker) and swapped out (kind=swap); and the least memory the "
    "trainer's container could still allocate while they ran (kind=available: its memory "
    "cgroup's limit minus usage, else the host's available memory), what more workers would "
    "have to fit in.",
    "bytes", (*LOADER_LABELS, "kind"), TRAINER)
WORKER_MAX_RSS = _m(
    "dataloader_worker_max_rss_bytes", GAUGE,
    "The largest resident memory any worker of the loader has had (a high-water mark).",
    "bytes", LOADER_LABELS, TRAINER)
# Copy-on-read (instrument/cowscan.py): a worker that reads Python objects its parent holds
# writes their reference counts and so copies their pages; its private memory grows.
WORKER_PRIVATE_GROWTH = _m(
    "dataloader_worker_private_growth_bytes_per_second", GAUGE,
    "How fast the private memory (USS) of the loader's workers grows, summed over the live "
    "workers read for long enough (each a robust slope over its readings of the last 5 "
    "minutes, its start left out, a few MiB either way read as flat, so that the batches in "
    "hand do not count); the latest measured, kept after the workers end; absent until one "
    "was.",
    "bytes", LOADER_LABELS, TRAINER)
# The container is named by its labels, its item count a label too, as dataloader_info's
# settings are: a fact that does not change, in one series (the series budget).
DATASET_LABELS: tuple[str, ...] = (*LOADER_LABELS, "attribute", "container", "item", "objects")
DATASET_OBJECTS = _m(
    "dataloader_dataset_objects_bytes", GAUGE,
    "Estimated size (from a sample of its items) of the largest container of Python objects "
    "in the dataset (a list, tuple, dict, object array or pandas column of 100,000 items or "
    "more among its attributes, through Subset, ConcatDataset and other datasets it holds), "
    "looked at once before the loader's first forked workers start: every worker that reads "
    "its items writes their reference counts and so copies their pages (copy-on-read), "
    "about this much each once it has read them all. attribute: its path (dataset.paths); "
    "container and item: their types; objects: its items. Absent where none was found.",
    "bytes", DATASET_LABELS, TRAINER)
# Why a worker failed, as observed: never a cause that was not seen (instrument/failure_causes.py).
FAILURE_CAUSES: tuple[str, ...] = ("oom", "killed", "crash", "shm", "error")
FAILURES = _m(
    "dataloader_failures_total", COUNTER,
    "Failures of the loader and its workers by cause, each written once seen: oom (a worker "
    "killed while the cgroup's OOM-kill count rose), killed (another kill signal), crash "
    "(a crash signal such as SIGSEGV, or an abnormal exit), shm (/dev/shm full: an "
    "allocation error or SIGBUS), error (the dataset or collate_fn raised).",
    "", (*LOADER_LABELS, "cause"), TRAINER)

# --- gpu: NVML through nvidia-ml-py ------------------------------------------------------
GPU_LABELS: tuple[str, ...] = ("gpu", "gpu_uuid")
GPU_INFO = _m("gpu_info", GAUGE, "GPU model and driver; the value is always 1.", "",
              (*GPU_LABELS, "name", "driver_version"), GPU)
GPU_UTILIZATION = _m(
    "gpu_utilization_ratio", GAUGE,
    "Fraction of the last sample period during which a kernel ran on the GPU.",
    "ratio", GPU_LABELS, GPU)
GPU_MEMORY_UTILIZATION = _m(
    "gpu_memory_utilization_ratio", GAUGE,
    "Fraction of the last sample period during which device memory was read or written.",
    "ratio", GPU_LABELS, GPU)
GPU_MEMORY_USED = _m(
    "gpu_memory_used_bytes", GAUGE, "Device memory in use.", "bytes", GPU_LABELS, GPU)
GPU_MEMORY_TOTAL = _m(
    "gpu_memory_total_bytes", GAUGE, "Device memory in total.", "bytes", GPU_LABELS, GPU)
GPU_PCIE_RX = _m(
    "gpu_pcie_rx_bytes_per_second", GAUGE,
    "PCIe traffic received by the GPU (host to device), averaged over NVML's 20 ms window.",
    "bytes_per_second", GPU_LABELS, GPU)
GPU_PCIE_TX = _m(
    "gpu_pcie_tx_bytes_per_second", GAUGE,
    "PCIe traffic sent by the GPU (device to host), averaged over NVML's 20 ms window.",
    "bytes_per_second", GPU_LABELS, GPU)
GPU_TEMPERATURE = _m(
    "gpu_temperature_celsius", GAUGE, "GPU core temperature.", "celsius", GPU_LABELS, GPU)
GPU_POWER = _m("gpu_power_watts", GAUGE, "GPU power draw.", "watts", GPU_LABELS, GPU)

# --- shm: the shared-memory filesystem DataLoader workers pass batches through ------------
SHM_SIZE = _m("shm_size_bytes", GAUGE, "Size of the shared-memory filesystem.",
              "bytes", ("path",), SHM)
SHM_USED = _m("shm_used_bytes", GAUGE, "Bytes in use on the shared-memory filesystem.",
              "bytes", ("path",), SHM)
SHM_FREE = _m("shm_free_bytes", GAUGE, "Bytes free on the shared-memory filesystem.",
              "bytes", ("path",), SHM)

# --- host: memory of the machine and of the container's cgroup ----------------------------
HOST_MEMORY_TOTAL = _m("host_memory_total_bytes", GAUGE, "Physical memory of the host.",
                       "bytes", (), HOST)
HOST_MEMORY_AVAILABLE = _m(
    "host_memory_available_bytes", GAUGE,
    "Memory available to new work without swapping, as the kernel estimates it.",
    "bytes", (), HOST)
HOST_SWAP_USED = _m("host_swap_used_bytes", GAUGE, "Swap space in use.", "bytes", (), HOST)
CGROUP_MEMORY_LIMIT = _m(
    "host_cgroup_memory_limit_bytes", GAUGE,
    "Memory limit of the exporter's cgroup (the container), where one is set.", "bytes", (), HOST)
CGROUP_MEMORY_USAGE = _m(
    "host_cgroup_memory_usage_bytes", GAUGE,
    "Memory in use by the exporter's cgroup (the container).", "bytes", (), HOST)

# --- the exporter itself --------------------------------------------------------------------
BUILD_INFO = _m(
    "dataloader_exporter_build_info", GAUGE,
    "Version of dataloader-exporter and of Python; the value is always 1.",
    "", ("version", "python_version"), SELF)
COLLECTOR_UP = _m(
    "dataloader_exporter_collector_up", GAUGE,
    "Whether the collector's source could be read at the last scrape (1) or not (0).",
    "", ("collector",), SELF)
COLLECTOR_DURATION = _m(
    "dataloader_exporter_collector_duration_seconds", GAUGE,
    "Time the collector took at the last scrape.", "seconds", ("collector",), SELF)
COLLECTOR_ERRORS = _m(
    "dataloader_exporter_collector_errors_total", COUNTER,
    "Errors the collector met reading its source (each skipped file or failed call).",
    "", ("collector",), SELF)
SNAPSHOT_AGE = _m(
    "dataloader_exporter_snapshot_age_seconds", GAUGE,
    "Age of the newest trainer snapshot file in the metrics directory.", "seconds", (), SELF)
SNAPSHOT_FILES = _m(
    "dataloader_exporter_snapshot_files", GAUGE,
    "Trainer snapshot files in the metrics directory, fresh ones served and stale ones dropped.",
    "", ("state",), SELF)
SNAPSHOT_ERRORS = _m(
    "dataloader_exporter_snapshot_errors_total", COUNTER,
    "Trainer snapshot files skipped whole, counted once per file and reason.",
    "", ("reason",), SELF)
COLLECTIONS = _m(
    "dataloader_exporter_collections_total", COUNTER,
    "Collections run to answer scrapes of /metrics; concurrent scrapes share one.", "", (), SELF)

ALL: tuple[Metric, ...] = tuple(v for v in globals().values() if isinstance(v, Metric))
BY_NAME: dict[str, Metric] = {m.name: m for m in ALL}

# Older trainers' snapshots (beside a newer sidecar) are still accepted: their retired
# families, validated and dropped (not in ALL), their metrics' former bucket layouts and
# label sets (the exit time per loader, served once per rank), without the families added.
RETIRED: tuple[Metric, ...] = (_m(
    "dataloader_worker_heartbeat_timestamp_seconds", GAUGE, "Unix time at which each worker "
    "process last finished a batch.", "seconds", WORKER_LABELS, TRAINER),)
FORMER_BUCKETS: dict[str, tuple[tuple[float, ...], ...]] = {STEP.name: (STEP_BINS,)}
FORMER_LABELS: dict[str, tuple[str, ...]] = {EXITED.name: LOADER_LABELS}
ADDED: tuple[Metric, ...] = (LOOP_CPU, WORKER_PRIVATE_GROWTH, DATASET_OBJECTS)


def series_names(metric: Metric) -> tuple[str, ...]:
    """Every sample name the metric shows up under in an exposition."""
    if metric.type == HISTOGRAM:
        return (f"{metric.name}_bucket", f"{metric.name}_sum", f"{metric.name}_count")
    return (metric.name,)


def markdown_table(source: str | None = None) -> str:
    """The metric reference table of docs/metrics.md (all metrics, or one source's).

    Generated so the docs cannot drift from the catalogue; tests/test_catalogue.py fails
    when docs/metrics.md does not hold it.
    """
    rows = ["| name | type | labels | meaning |", "|---|---|---|---|"]
    for m in ALL:
        if source is None or m.source == source:
            labels = ", ".join(m.labels) or "-"
            rows.append(f"| `{m.name}` | {m.type} | {labels} | {m.help} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # the table to paste between docs/metrics.md's markers
    print(markdown_table(), end="")
