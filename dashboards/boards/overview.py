"""The "DataLoader overview" dashboard: is the GPU starving, and why?

Read it top down: the first row answers "starving or not", the next rows say where the
time goes (waiting for batches, the step, the host-to-device copy, epoch starts), then
why the workers are slow (running, waiting for a CPU or blocked; their memory and reads)
and why they fail, what the loader tuner changed where it is on, and the last rows show
the resources a loader runs out of (/dev/shm, host memory).
"""

from __future__ import annotations

from dataloader_exporter.core import bands
from dataloader_exporter.core import catalogue as cat

from .. import dcgm
from ..model import (
    BARGAUGE,
    BYTES,
    BYTES_PER_SECOND,
    COUNT,
    GAUGE,
    RATIO,
    SECONDS,
    STAT,
    Board,
    Panel,
    Row,
    Step,
    Variable,
)
from ..promql import (
    BY_RANK,
    HOST,
    LOADER,
    RATE_INTERVAL,
    job_stall_share,
    mean,
    quantile,
    rank_fetch_per_batch,
    rank_step_per_batch,
    rate,
    ratio,
    sel,
    stall_share,
    straggler_excess,
    wait_for_ranks,
)
from .row_tuner import TUNER
from .row_workers import WHY_WORKERS

W = RATE_INTERVAL

# TensorFlow profiler's bands: under 5% fine, 5-20% worth a look, over 20% input-bound.
STALL_BANDS: tuple[Step, ...] = ((None, "green"), (bands.MODERATE, "yellow"),
                                  (bands.INPUT_BOUND, "red"))
GPU_BANDS: tuple[Step, ...] = ((None, "red"), (bands.GPU_IDLE, "yellow"),
                                (bands.GPU_BUSY, "green"))
SHM_BANDS: tuple[Step, ...] = ((None, "green"), (0.9, "orange"), (0.98, "red"))
FETCH = {"phase": cat.PHASE_FETCH}
TRANSFER = {"phase": cat.PHASE_TRANSFER}
STALL_FIX = (
    " When it is high: raise num_workers (up to the physical cores), set pin_memory=True "
    "and persistent_workers=True, raise prefetch_factor, and make __getitem__ cheaper "
    "(decode or augment less, cache, move work to the GPU).")


def gpu_of_rank(matchers: str) -> str:
    """Each (loader, rank)'s GPU utilization, 0-1, joined on the GPU's UUID: the
    exporter's NVML series, or dcgm-exporter's (its UUID label renamed)."""
    known = sel(cat.INFO, matchers + ',gpu_uuid!=""')
    info = f"max by (loader, rank, gpu_uuid) ({known})"
    nvml = f"max by (gpu_uuid) ({sel(cat.GPU_UTILIZATION)})"
    dcgm_ = (f'max by (gpu_uuid) (label_replace({dcgm.GPU_UTIL}, "gpu_uuid", "$1", "UUID", '
             f'"(.+)")) / 100')
    return f"{info} * on (gpu_uuid) group_left () ({nvml} or {dcgm_})"


headline = Row("Is the GPU starving?", (
    Panel("Input stall share of the job",
          "Share of the job's time every rank spends waiting for input. In synchronous data "
          "parallel (DDP, FSDP, torchrun) each step waits for the slowest rank, so this is "
          "the worst rank's fetch wait per batch over the common batch period (fetch wait "
          "plus step), not the mean over ranks; for a single process it is fetch wait / "
          "(fetch wait + step time). The highest over the selected jobs and loaders. Good: "
          f"under {bands.MODERATE:.0%}. {bands.MODERATE * 100:.0f}-{bands.INPUT_BOUND:.0%} is "
          f"worth a look; over {bands.INPUT_BOUND:.0%} the job is input-bound and the GPUs "
          "idle. Which rank it comes from: Input stragglers." + STALL_FIX,
          RATIO, (("job stall share", f"max({job_stall_share(LOADER, W)})"),), STAT,
          STALL_BANDS, 0, 1),
    Panel("Samples per second",
          "Samples handed to the training loop per second, all selected loaders and ranks. "
          "Good: steady at the rate the model can consume. A drop with a rising stall share "
          "means the input pipeline slowed down (storage, CPU contention).",
          COUNT, (("samples/s", f"sum({rate(sel(cat.SAMPLES, LOADER), W)})"),), STAT),
    Panel("GPU utilization",
          "Mean share of time a kernel ran, over the selected instances' GPUs (from the "
          "exporter's NVML collector, or in Kubernetes from dcgm-exporter, joined on the "
          f"pods). Good: over {bands.GPU_BUSY:.0%} while training. Low utilization together "
          "with a high input "
          "stall share means the GPU is starving for data; low utilization with a low stall "
          "share points at the model or the step (small batches, synchronisation).",
          RATIO, (("GPU utilization", f"avg({sel(cat.GPU_UTILIZATION, HOST)}) or "
                                      f"avg({dcgm.gpu_utilization(HOST)})"),), GAUGE,
          GPU_BANDS, 0, 1),
    Panel("Input stragglers",
          f"Ranks whose fetch wait per batch exceeds the median rank's by {bands.MODERATE:.0%} "
          "of the batch "
          "period or more (the DataLoaderInputStraggler alert's test): every other rank "
          "waits for their input at each step. Good: 0. Otherwise see Input stragglers by "
          "rank for which, and fix that rank's input (its host's storage, cores, /dev/shm, "
          "num_workers), not the others'.",
          COUNT, (("stragglers", f"count(({straggler_excess(LOADER, W)}) >= {bands.STRAGGLER}) or "
                                 f"(0 * count({rank_fetch_per_batch(LOADER, W)}))"),),
          STAT, ((None, "green"), (1, "red"))),
))

stall = Row("Where the time goes", (
    Panel("Input stall share",
          "Per loader and rank: fetch wait / (fetch wait + step time). Good: under the "
          f"{bands.MODERATE:.0%} "
          f"line. Above {bands.INPUT_BOUND:.0%} the job is input-bound." + STALL_FIX,
          RATIO, ((BY_RANK, stall_share(LOADER, W)),), thresholds=STALL_BANDS, max=1),
    Panel("Each rank's GPU beside its input stall share",
          "The utilization of the GPU each rank feeds (joined on dataloader_info's gpu_uuid, "
          "which a loader learns at its first to_device onto CUDA), next to the rank's own "
          "stall share. Good: utilization high where the stall is low. A rank with a high "
          "stall and an idle GPU starves; an idle GPU on a rank with a low stall waits for "
          "other ranks.",
          RATIO, (("GPU of {{loader}} rank {{rank}}", gpu_of_rank(LOADER)),
                  (f"stall {BY_RANK}", stall_share(LOADER, W))), max=1),
    Panel("GPU utilization and input stall share",
          "Both on one axis so their correlation shows. Good: utilization high, stall low. "
          "When the stall share rises as utilization falls, the GPU is waiting for input: "
          "fix the loader (see Input stall share). When both are low, the GPU waits on "
          "something else (communication, the host side of the step).",
          RATIO, (("GPU {{gpu}} utilization ({{instance}})", sel(cat.GPU_UTILIZATION, HOST)),
                  ("GPU {{gpu}} utilization ({{pod}}, dcgm-exporter)",
                   dcgm.gpu_utilization(HOST)),
                  (f"stall {BY_RANK}", stall_share(LOADER, W))), max=1),
    Panel("Fetch wait per batch",
          "How long the loop blocked in next() for each batch: p50, p95 and p99. Good: "
          "microseconds to a millisecond (the batch was prefetched). A high p50 means workers "
          "cannot keep up on average (more workers, cheaper samples); a high p99 with a low "
          "p50 means occasional slow samples (cold storage, huge items, GC).",
          SECONDS, tuple((f"p{round(q * 100)} {BY_RANK}", quantile(q, cat.TIME, LOADER, W, **FETCH))
                         for q in (0.5, 0.95, 0.99))),
    Panel("Input stragglers by rank",
          "The ten ranks whose input holds the others back most: each one's fetch wait per "
          "batch above the median rank's, as a share of the job's batch period (that much "
          "of every other rank's time goes to waiting for it). Reads the same with 2, 8 or "
          f"64 ranks. Good: every bar under {bands.MODERATE:.0%} (red from there: an input "
          "straggler)." ,
          RATIO, ((BY_RANK, f"topk(10, {straggler_excess(LOADER, W)})"),), BARGAUGE,
          ((None, "green"), (bands.STRAGGLER, "red")), 0, 1),
    Panel("The job's stall against each rank's own",
          "Per job and loader the job-level stall share (what every rank loses), and each "
          "rank's own share. Good: all low. A rank's own share far above the others' is an "
          "input straggler; ranks with a low share of their own still lose the job's share, "
          "waiting for it inside their step.",
          RATIO, (("job {{job}} {{loader}}", job_stall_share(LOADER, W)),
                  (f"own {BY_RANK}", stall_share(LOADER, W))), max=1),
))

throughput = Row("Throughput and step", (
    Panel("Throughput: samples per second",
          "Samples handed to the loop per second, per loader and rank. Good: flat. Dips "
          "that line up with stall spikes are the input pipeline; dips without them are the "
          "step (evaluation, checkpointing).",
          COUNT, ((BY_RANK, rate(sel(cat.SAMPLES, LOADER), W)),)),
    Panel("Throughput: batches per second",
          "Batches handed to the loop per second, per loader and rank. Good: flat. In "
          "synchronous data parallel every rank runs at the same rate, straggler or not "
          "(each step waits for the slowest): look for stragglers in Input stragglers by rank.",
          COUNT, ((BY_RANK, rate(sel(cat.BATCHES, LOADER), W)),)),
    Panel("Step time",
          "Time between batches spent outside the loader (the training step): mean and p95. "
          "Good: stable. In data parallel the step includes waiting for other ranks in the "
          "collective (see Step: waiting for other ranks): only the fastest rank's step is "
          "close to compute. When even that is much longer than the fetch wait, the loader "
          "is not the bottleneck.",
          SECONDS, ((f"mean {BY_RANK}", mean(cat.STEP, LOADER, W)),
                    (f"p95 {BY_RANK}", quantile(0.95, cat.STEP, LOADER, W)))),
    Panel("Step: waiting for other ranks (estimate)",
          "Per rank and batch, the part of its step spent waiting for slower ranks in the "
          "collective (all-reduce), estimated as its step minus the fastest rank's: that "
          "part is not compute, and optimising this rank's model will not shorten it. Good: "
          "near 0 on every rank. A large wait on all ranks but one points at that one.",
          SECONDS, ((BY_RANK, wait_for_ranks(LOADER, W)),
                    (f"step {BY_RANK}", rank_step_per_batch(LOADER, W)))),
    Panel("Time to first batch",
          "Mean time from the start of an epoch (iter) to its first batch, for the epochs "
          "that started in each interval. Good: well under a second. Seconds to minutes is "
          "the epoch-start stall: set persistent_workers=True so workers survive between "
          "epochs, and keep the dataset's __init__ and worker_init_fn light.",
          SECONDS, ((BY_RANK, mean(cat.FIRST_BATCH, LOADER, W)),)),
))

transfer = Row("Host to device", (
    Panel("Transfer time per batch",
          "Time to_device() took per batch (copy host to device): mean and p95. Good: a small "
          "fraction of the step. When it is large, use pin_memory=True and non_blocking=True "
          "so the copy overlaps compute, or send smaller dtypes (uint8 images, not float32).",
          SECONDS, ((f"mean {BY_RANK}", mean(cat.TIME, LOADER, W, **TRANSFER)),
                    (f"p95 {BY_RANK}", quantile(0.95, cat.TIME, LOADER, W, **TRANSFER)))),
    Panel("Effective host-to-device bandwidth",
          "Bytes moved by to_device() divided by the time it took. Good: near the link's "
          "rate (PCIe 4 x16: about 25 GB/s pinned). Far lower means pageable memory "
          "(set pin_memory=True) or many small tensors per batch (collate into fewer).",
          BYTES_PER_SECOND,
          ((BY_RANK, f"{rate(sel(cat.TRANSFER_BYTES, LOADER), W)} / ignoring(phase) "
                     f"{rate(sel(cat.TIME, LOADER, '_sum', **TRANSFER), W)}"),)),
))

workers = Row("Workers and batches", (
    Panel("Workers active against configured",
          "Worker processes alive against num_workers, and workers lost. Good: active equals "
          "configured while an epoch runs. With persistent_workers=False active drops to 0 "
          "between epochs (that is the epoch-start stall), and a worker whose IterableDataset "
          "shard ran out ends early on purpose. A lost worker died while it was needed: "
          "Worker failures by cause says why.",
          COUNT, ((f"active {BY_RANK}", sel(cat.WORKERS_ACTIVE, LOADER)),
                  (f"configured {BY_RANK}", sel(cat.WORKERS_CONFIGURED, LOADER)),
                  (f"lost {BY_RANK}", f"increase({sel(cat.WORKERS_LOST, LOADER)}[{W}])"))),
    Panel("Worker CPU share",
          "CPU each worker process uses, as a share of one core (where the rest of their wall "
          "time goes: Worker time by state). Good: "
          "below 90% with a low stall share. Near 100% with a high stall share: the workers "
          "are CPU-bound (add workers if cores are free, make samples cheaper). Low with a "
          "high stall share: samples wait on storage or the network (more workers overlap "
          "I/O), or the bottleneck is between workers and the loop (large batches through "
          "/dev/shm, the pin_memory thread, a slow collate in the main process).",
          RATIO, (("{{loader}} rank {{rank}} worker {{worker}}",
                   rate(sel(cat.WORKER_CPU, LOADER), W)),),
          BARGAUGE, ((None, "blue"), (0.9, "orange")), 0, 1),
    Panel("Batch bytes",
          "Tensor bytes in a recent batch. In flight through /dev/shm are about batch bytes "
          "x prefetch_factor x num_workers; keep that well under the /dev/shm size. Good: "
          "stable; growth means variable-size samples (padding, long sequences).",
          BYTES, ((BY_RANK, sel(cat.BATCH_BYTES, LOADER)),)),
))

memory = Row("Memory", (
    Panel("/dev/shm used against size",
          "Bytes in use on the shared-memory filesystem workers pass batches through, and its "
          "size. Good: used well below size. Near full, workers die with 'Bus error': give "
          "the container a larger --shm-size (Kubernetes: a memory-backed emptyDir on "
          "/dev/shm) or lower num_workers, prefetch_factor or the batch size.",
          BYTES, (("used {{instance}} {{path}}", sel(cat.SHM_USED, HOST)),
                  ("size {{instance}} {{path}}", sel(cat.SHM_SIZE, HOST)))),
    Panel("/dev/shm used share",
          "The fullest selected /dev/shm, used / size. Good: under 90%. Above 98% the next "
          "batch may not fit and workers crash: see /dev/shm used against size for the fix.",
          RATIO, (("used share", f"max({ratio(cat.SHM_USED, cat.SHM_SIZE, HOST)})"),),
          GAUGE, SHM_BANDS, 0, 1),
    Panel("Host memory available and swap",
          "Memory available without swapping, total memory, and swap in use. Good: available "
          "above 10% of total and swap flat. Falling available memory with growing swap "
          "slows workers to a crawl: fewer workers, smaller prefetch_factor, or datasets that "
          "share memory (numpy arrays instead of Python lists, to avoid copy-on-access).",
          BYTES, (("available {{instance}}", sel(cat.HOST_MEMORY_AVAILABLE, HOST)),
                  ("total {{instance}}", sel(cat.HOST_MEMORY_TOTAL, HOST)),
                  ("swap used {{instance}}", sel(cat.HOST_SWAP_USED, HOST)))),
))

exporter_health = Row("Exporter", (
    Panel("Newest trainer snapshot age",
          "Age of the newest snapshot file a trainer wrote. Good: a second or two (trainers "
          "rewrite it every second). Growing: the trainer exited or hangs, and its metrics "
          "are dropped after --stale-after.",
          SECONDS, (("{{instance}}", sel(cat.SNAPSHOT_AGE, HOST)),), STAT,
          ((None, "green"), (10, "yellow"), (60, "red"))),
    Panel("Collectors up",
          "Whether each collector could read its source at the last scrape. Good: all up. "
          "gpu down on a host without NVIDIA drivers is expected (disable it with "
          "--no-collector.gpu); trainer down means the metrics directory is unreadable.",
          "bool_yes_no", (("{{instance}} {{collector}}", sel(cat.COLLECTOR_UP, HOST)),),
          BARGAUGE, ((None, "red"), (1, "green")), 0, 1),
))

OVERVIEW = Board(
    uid="dataloader-overview",
    title="DataLoader overview",
    description="Is the GPU starving, and why? Input stall share, fetch wait, throughput, "
                "workers and memory of instrumented PyTorch DataLoaders.",
    variables=(
        Variable("datasource", "Data source"),
        Variable("job", "Job", cat.BATCHES.name),
        Variable("instance", "Instance", sel(cat.BATCHES, 'job=~"$job"')),
        Variable("loader", "Loader", sel(cat.BATCHES, HOST)),
        Variable("rank", "Rank", sel(cat.BATCHES, HOST + ',loader=~"$loader"')),
    ),
    rows=(headline, stall, throughput, transfer, workers, WHY_WORKERS, TUNER, memory,
          exporter_health),
)
