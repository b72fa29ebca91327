"""The alerts, each defined once: the three classic input-pipeline failures (data
starvation, epoch-start stalls, /dev/shm overflow), crashes and hangs, memory that runs
out (the host's, the workers' growing towards an OOM kill), and the health of the exporter
itself. dashboards.alerting renders them for Grafana and for Prometheus.

Every expression returns only positive values when it fires (see model.Alert), and no
dashboard variables: alerts see every job.
"""

from __future__ import annotations

from dataloader_exporter.core import bands
from dataloader_exporter.core import catalogue as cat

from . import dcgm
from .model import CRITICAL, EXPORTER_CONTAINER, EXPORTER_JOB, WARNING, Alert
from .promql import (
    GROWTH_HORIZON_S,
    quantile,
    ratio,
    sel,
    stall_share,
    straggler_excess,
    worker_memory,
    worker_state_share,
)

WINDOW = "5m"
# Epoch starts are rare events: average the first batches of the last hour.
EPOCH_WINDOW = "1h"
# The trainer rewrites its snapshot every second; older than this, it is not writing.
FRESH_SNAPSHOT = 60
LOADER = "{{ $labels.loader }} rank {{ $labels.rank }} on {{ $labels.instance }}"

_first_batch = (f"rate({sel(cat.FIRST_BATCH, suffix='_sum')}[{EPOCH_WINDOW}]) / "
                f"rate({sel(cat.FIRST_BATCH, suffix='_count')}[{EPOCH_WINDOW}])")
_median_wait = quantile(0.5, cat.TIME, "", EPOCH_WINDOW, phase=cat.PHASE_FETCH)
# A worker lost in the window, by the cause the trainer observed (a worker dies of these;
# "error" is the dataset raising, which the loop sees itself); a loss with no cause
# observed, or from a trainer that records none, fires as cause "unknown".
LOST_WINDOW = "10m"
DEATHS = "|".join(c for c in cat.FAILURE_CAUSES if c != "error")
_deaths = sel(cat.FAILURES, 'cause=~"' + DEATHS + '"')
# A cause's counter is written once seen: a series that first shows up already above 0
# (the trainer failed within a scrape of its first failure) has no increase() to show,
# and counts as new for the window.
_lost = (f"((increase({_deaths}[{LOST_WINDOW}]) > 0) or ({_deaths} > 0 unless "
         f"{_deaths} offset {LOST_WINDOW})) or ignoring (cause) "
         f'label_replace(increase({sel(cat.WORKERS_LOST)}[{LOST_WINDOW}]) > 0, "cause", '
         '"unknown", "", "")')
# Copy-on-read: the growth of the workers' private memory the trainer measures, projected
# GROWTH_HORIZON_S ahead, against the least room its container had while they ran (limit
# minus usage), while workers live. The gauge is the rate, not deriv() of the workers'
# PSS: a page one of n workers copies leaves the shared set, so their PSS grows by half of
# it to nearly all (n/(n+1) on average over the n copies). The gauge is kept after the
# workers end and until a new pool's is measured, so their PSS must confirm it: rising over
# half an hour (hundreds of batches, past those in hand) at least 1/PSS_SHARE as fast. Not
# `> 0`: a flat PSS's slope has either sign (the batches in hand), and would let a stale
# gauge through about half the time.
GROWTH_MINUTES = 30
GROWTH_WINDOW = f"{GROWTH_MINUTES}m"
PSS_SHARE = 4
_rate = sel(cat.WORKER_PRIVATE_GROWTH)
_pss_slope = f"sum without (kind) (deriv({worker_memory('pss')}[{GROWTH_WINDOW}]))"
_growth = (f"({_rate} * {GROWTH_HORIZON_S} > ignoring (kind) {worker_memory('available')}) "
           f"and ({sel(cat.WORKERS_ACTIVE)} > 0) and ({_pss_slope} * {PSS_SHARE} > {_rate})")
_HOURS = f"{GROWTH_HORIZON_S // 3600} hours"

ALERTS: tuple[Alert, ...] = (
    Alert(
        "DataLoaderInputBound",
        f"({stall_share('', WINDOW)} > {bands.INPUT_BOUND}) unless on (job, instance) "
        f"(avg by (job, instance) ({sel(cat.GPU_UTILIZATION)}) >= {bands.GPU_IDLE}) "
        f"unless on (namespace, pod) (avg by (namespace, pod) ({dcgm.pod_utilization()}) "
        f">= {bands.GPU_IDLE})",
        "10m", WARNING,
        f"Input-bound: {LOADER} waits for data over {bands.INPUT_BOUND:.0%} of the time",
        f"The training loop spent over {bands.INPUT_BOUND:.0%} of its time waiting for batches "
        "for 10 minutes"
        " (and, where GPU metrics exist, the instance's GPUs, or in Kubernetes the pod's"
        f" GPUs as dcgm-exporter sees them, were under {bands.GPU_IDLE:.0%} busy): the GPU"
        " is starving. Fix: raise num_workers (up to the physical cores), set"
        " pin_memory=True and persistent_workers=True, raise prefetch_factor, and make"
        " __getitem__ cheaper (decode or augment less, cache decoded samples, move"
        " augmentation to the GPU).",
    ),
    Alert(
        "DataLoaderInputStraggler",
        f"{straggler_excess('', WINDOW)} >= {bands.STRAGGLER}",
        "10m", WARNING,
        "Input straggler: {{ $labels.loader }} rank {{ $labels.rank }} holds back the other "
        "ranks of {{ $labels.job }}",
        "In synchronous data parallel every step waits for the slowest rank. This rank's"
        f" loop waits for its input longer than the median rank's by over {bands.MODERATE:.0%} "
        "of the job's"
        " batch period (the value), and every other rank spends that time waiting for it"
        " inside its step. Fix this rank's input, not the others': its host's storage,"
        " cores (other ranks' workers on the same machine), /dev/shm and num_workers; an"
        " uneven shard of the data (DistributedSampler with uneven sample costs). Run"
        " `dataloader-exporter doctor --prometheus` for the figures.",
    ),
    Alert(
        "DataLoaderEpochStartStall",
        f"({_first_batch} > 10) or "
        f"(({_first_batch} > ignoring (phase) (10 * {_median_wait})) and ({_first_batch} > 1))",
        "1m", WARNING,
        f"Epoch-start stall: {LOADER} waits long for each epoch's first batch",
        "The first batch of recent epochs took over 10 s, or over 10x the median batch wait"
        " (and over 1 s): workers are started from scratch at every epoch and the GPU idles"
        " meanwhile. Fix: persistent_workers=True, so workers survive between epochs; keep"
        " the dataset's __init__ and worker_init_fn light (open files lazily).",
    ),
    Alert(
        "DataLoaderShmNearlyFull",
        f"{ratio(cat.SHM_USED, cat.SHM_SIZE)} > 0.9",
        "2m", WARNING,
        "/dev/shm over 90% full on {{ $labels.instance }}",
        "The shared-memory filesystem DataLoader workers pass batches through is over 90%"
        " full; when a batch no longer fits, workers die with 'Bus error'. Fix: give the"
        " container a larger --shm-size (Kubernetes: a memory-backed emptyDir mounted on"
        " /dev/shm), or lower num_workers, prefetch_factor or the batch size.",
    ),
    Alert(
        "DataLoaderShmFull",
        f"{ratio(cat.SHM_USED, cat.SHM_SIZE)} > 0.98",
        "2m", CRITICAL,
        "/dev/shm over 98% full on {{ $labels.instance }}: workers are about to crash",
        "The shared-memory filesystem is over 98% full: the next batch may not fit and"
        " DataLoader workers will die with 'Bus error'. Fix now: a larger --shm-size, or"
        " fewer num_workers, a lower prefetch_factor or smaller batches.",
    ),
    Alert(
        "DataLoaderWorkerLost",
        _lost,
        "0m", CRITICAL,
        f"DataLoader worker lost ({{{{ $labels.cause }}}}): {LOADER}",
        "A DataLoader worker process died while the loader still needed it, or failed for"
        " want of /dev/shm, in the last 10 minutes (a worker that finishes on purpose, at the"
        " end of an epoch or of its IterableDataset shard, is not counted). The cause label"
        " is what the trainer observed. Fix by cause: oom (killed while the cgroup's"
        " OOM-kill count rose): fewer num_workers or a lower prefetch_factor, a higher"
        " memory limit, datasets that share memory across workers (numpy arrays rather than"
        " Python lists of objects); shm (/dev/shm full): a larger --shm-size (Kubernetes: a"
        " memory-backed emptyDir's sizeLimit), or fewer workers or a lower prefetch_factor;"
        " crash (a crash signal, usually native decoding code): run with num_workers=0 to"
        " see the traceback, pin or upgrade the library; killed (a kill that was not the OOM"
        " killer's): find what sent it (the scheduler's events, the host's log); unknown (no"
        " cause observed, or a trainer that records none): check dmesg for the OOM killer"
        " and /dev/shm's size. `dataloader-exporter doctor` gives the sizes to use.",
    ),
    Alert(
        "DataLoaderWorkersCpuStarved",
        f"({worker_state_share('waiting_for_cpu', '', WINDOW)} >= {bands.CPU_CONTENTION}) and "
        f"({stall_share('', WINDOW)} > {bands.INPUT_BOUND})",
        "10m", WARNING,
        f"DataLoader workers starved of CPU: {LOADER}",
        f"The loader's workers spent {round(bands.CPU_CONTENTION * 100)}% of their time or more"
        " waiting for a CPU (runnable, in the run queue) for 10 minutes, while the training"
        f" loop waited for data over {bands.INPUT_BOUND:.0%} of the time: there are more "
        "runnable workers than"
        " cores for them (too many workers, other ranks' workers on the same machine, or"
        " other processes on the cores). More workers make it worse. Fix: fewer num_workers"
        " (at most the cores per local rank; `dataloader-exporter doctor` says how many get"
        " a core), a CPU quota or affinity that gives the job the cores it asks for, or"
        " move other work off those cores.",
    ),
    Alert(
        "DataLoaderStalled",
        f"(time() - max by (job, instance, rank) ({sel(cat.LAST_BATCH)}) > 300) and on "
        f"(job, instance) ({sel(cat.SNAPSHOT_AGE)} < {FRESH_SNAPSHOT})",
        "1m", CRITICAL,
        "No batch for 5 minutes from rank {{ $labels.rank }} on {{ $labels.instance }}",
        "No loader of this trainer handed out a batch for 5 minutes, yet the trainer is"
        " alive (its snapshots are fresh): the loop hangs. Usual causes: a deadlocked"
        " worker (fork after threads or CUDA; use multiprocessing_context='spawn' or"
        " 'forkserver'), a stuck read from network storage, a collective waiting for another"
        " rank. Fix: py-spy dump the trainer and its workers; set DataLoader timeout= so"
        " hangs raise.",
    ),
    Alert(
        "DataLoaderExporterDown",
        f'1 - (up{{job="{EXPORTER_JOB}"}} or up{{container="{EXPORTER_CONTAINER}"}}) > 0',
        "2m", WARNING,
        "dataloader-exporter on {{ $labels.instance }} cannot be scraped",
        "Prometheus could not scrape the dataloader-exporter for 2 minutes: no DataLoader,"
        " GPU or /dev/shm metrics, and no other alert, from this host. Fix: check that the"
        " sidecar runs and listens (default port 9478) and that its address in the scrape"
        " config is right (Kubernetes: the pod's dataloader-exporter container, its probes"
        " and its log).",
    ),
    Alert(
        "DataLoaderSnapshotsStale",
        f'(max without (state) ({sel(cat.SNAPSHOT_FILES, state="stale")} > 0) unless on '
        f'(job, instance) ({sel(cat.SNAPSHOT_FILES, state="fresh")} > 0)) or '
        f"({sel(cat.SNAPSHOT_AGE)} > {FRESH_SNAPSHOT})",
        "2m", WARNING,
        "Trainer snapshots on {{ $labels.instance }} are stale",
        "The exporter finds only stale trainer snapshot files (or the newest is over a"
        " minute old): the trainer exited, crashed or hangs, and its metrics are no longer"
        " served. Fix: check the trainer; if it runs, check it still writes to the shared"
        " metrics directory (look for 'cannot write metrics snapshot' in its log).",
    ),
    Alert(
        "DataLoaderGpuCollectorDown",
        f'1 - {sel(cat.COLLECTOR_UP, collector=cat.GPU)} > 0',
        "5m", WARNING,
        "GPU metrics unavailable on {{ $labels.instance }}",
        "The exporter cannot read NVML, so GPU utilization, memory and PCIe are missing and"
        " the input-bound alert cannot check the GPU. Fix: run the sidecar with the NVIDIA"
        " container runtime (--gpus all, or the nvidia.com/gpu resource), or turn the"
        " collector off with --no-collector.gpu on hosts without GPUs.",
    ),
    Alert(
        "DataLoaderHostMemoryPressure",
        f"(1 - {ratio(cat.HOST_MEMORY_AVAILABLE, cat.HOST_MEMORY_TOTAL)} > "
        f"{1 - bands.MEMORY_RESERVE}) or "
        f"(({sel(cat.HOST_SWAP_USED)} > 0) and (deriv({sel(cat.HOST_SWAP_USED)}[10m]) > 0))",
        "5m", WARNING,
        "Memory pressure on {{ $labels.instance }}",
        f"Under {bands.MEMORY_RESERVE:.0%} of host memory is available, or swap is in use and "
        "growing: workers slow"
        " down and the OOM killer is next. Fix: fewer num_workers or a lower"
        " prefetch_factor; keep datasets in numpy arrays or tensors (Python objects get"
        " copied into every worker on access); free page cache hogs on the host.",
    ),
    Alert(
        "DataLoaderWorkerMemoryGrowth",
        _growth,
        "10m", WARNING,
        f"DataLoader workers' memory would outgrow the room left within {_HOURS}: {LOADER}",
        "The private memory (USS) of the loader's live workers grows, as the trainer"
        " measures it (summed over the workers, each over its last minutes, past the batches"
        " it has in hand), fast enough to take more than the memory the trainer's container"
        f" could still allocate (its least while the workers ran) within {_HOURS} (the value:"
        f" that growth, in bytes); their PSS has risen over the last {GROWTH_MINUTES} minutes"
        " too. The workers or the trainer will be OOM-killed hours into the run. The usual"
        " cause is copy-on-read: Python objects the dataset holds, such as a list of paths or"
        " of dicts, are copied into every worker as it reads them (reading an object writes"
        f" its reference count, and so its page); {cat.DATASET_OBJECTS.name} names the"
        " attribute that holds the largest such container (its labels: attribute, container,"
        " item, objects) and about what each worker copies once it has read it all. A cache"
        " the dataset fills in each worker, or a leak, grows it too. Fix: store such an"
        ' attribute as a numpy array (np.array(paths, dtype="S"): bytes, no Python objects),'
        " a pyarrow array or a tensor, and build the item from it in __getitem__; bound any"
        " cache a worker fills. `dataloader-exporter doctor` names the attribute and the"
        " time left.",
    ),
)
