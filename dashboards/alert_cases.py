"""promtool unit tests for every alert, as data: a case where it fires, one where it
stays quiet, and more where an alert has more than one way to fire or a near miss worth
pinning down. dashboards.alerting renders them into a `promtool test rules` file.

Series use promtool's notation at a 1-minute interval ('0+30x30': 0, 30, 60, ... for
31 minutes; '2x5 1x10': six 2s, then eleven 1s).
"""

from __future__ import annotations

from dataloader_exporter.core import catalogue as cat

from . import dcgm
from .model import EXPORTER_CONTAINER, EXPORTER_JOB, Case
from .promql import sel, selector

HOST = {"job": EXPORTER_JOB, "instance": "trainer-0:9478"}
LOADER = {**HOST, "loader": "train", "rank": "0"}
SHM = {**HOST, "path": "/dev/shm"}
GPU0 = {**HOST, "gpu": "0", "gpu_uuid": "GPU-0"}
FETCH = {**LOADER, "phase": cat.PHASE_FETCH}
POD = {"instance": "10.0.0.5:9478", "namespace": "team-a", "pod": "llm-0"}


def s(metric: cat.Metric, values: str, suffix: str = "", **labels: str) -> tuple[str, str]:
    """One input series: its selector with labels, and its values."""
    return sel(metric, "", suffix, **labels), values


def fires(*label_sets: dict[str, str]) -> tuple[tuple[tuple[str, str], ...], ...]:
    return tuple(tuple(sorted(ls.items())) for ls in label_sets)


def stall(fetch_per_minute: int) -> tuple[tuple[str, str], ...]:
    """Fetch wait against 30 s of step time a minute."""
    return (s(cat.TIME, f"0+{fetch_per_minute}x30", "_sum", **FETCH),
            s(cat.STEP, "0+30x30", "_sum", **LOADER))


def first_batch(seconds: float, median_5ms: bool = False) -> tuple[tuple[str, str], ...]:
    """One epoch starting at minute 10 whose first batch takes `seconds`."""
    out: tuple[tuple[str, str], ...] = (
        s(cat.FIRST_BATCH, f"0x10 {seconds}x20", "_sum", **LOADER),
        s(cat.FIRST_BATCH, "0x10 1x20", "_count", **LOADER))
    if median_5ms:  # 100 batches a minute, all under 10 ms: median wait 5 ms
        out += (s(cat.TIME, "0+100x30", "_bucket", **FETCH, le="0.01"),
                s(cat.TIME, "0+100x30", "_bucket", **FETCH, le="+Inf"))
    return out


def shm(used: int) -> tuple[tuple[str, str], ...]:
    return s(cat.SHM_USED, f"{used}x10", **SHM), s(cat.SHM_SIZE, "1000x10", **SHM)


def workers(active: str, lost: str = "0x15", last_batch: str = "0+60x15"
            ) -> tuple[tuple[str, str], ...]:
    return (s(cat.WORKERS_CONFIGURED, "2x15", **LOADER), s(cat.WORKERS_ACTIVE, active, **LOADER),
            s(cat.WORKERS_LOST, lost, **LOADER), s(cat.LAST_BATCH, last_batch, **LOADER))


def failures(**counts: str) -> tuple[tuple[str, str], ...]:
    """The failure counters of the causes given, as the trainer writes them: a cause's
    series appears once it has been seen."""
    return tuple(s(cat.FAILURES, counts[c], **LOADER, cause=c)
                 for c in cat.FAILURE_CAUSES if c in counts)


def worker_time(running: int, waiting_for_cpu: int, blocked: int
                ) -> tuple[tuple[str, str], ...]:
    """The workers' seconds a minute in each state (two workers: 120 in all)."""
    return tuple(s(cat.WORKER_TIME, f"0+{v}x30", **LOADER, state=state) for state, v in
                 zip(cat.WORKER_STATES, (running, waiting_for_cpu, blocked), strict=True))


def snapshot_files(fresh: int, stale: int) -> tuple[tuple[str, str], ...]:
    return (s(cat.SNAPSHOT_FILES, f"{fresh}x10", **HOST, state="fresh"),
            s(cat.SNAPSHOT_FILES, f"{stale}x10", **HOST, state="stale"))


def memory(available: int, swap: str) -> tuple[tuple[str, str], ...]:
    return (s(cat.HOST_MEMORY_TOTAL, "1000x15", **HOST),
            s(cat.HOST_MEMORY_AVAILABLE, f"{available}x15", **HOST),
            s(cat.HOST_SWAP_USED, swap, **HOST))


MIB = 2**20
GIB = 2**30
SPAN = 50  # minutes of each memory-growth case's series


def private_growth(per_second: int) -> tuple[str, str]:
    """The trainer's measure of how fast the loader's workers' private memory grows."""
    return s(cat.WORKER_PRIVATE_GROWTH, f"{per_second}x{SPAN}", **LOADER)


def pss(per_minute: int, until: int = SPAN) -> tuple[str, str]:
    """The loader's workers' PSS from 2 GiB, rising `per_minute` bytes a minute (absent
    after minute `until`, where given)."""
    values = f"{2 * GIB}+{per_minute}x{until}"
    return s(cat.WORKER_MEMORY, values + (f" _x{SPAN - until}" if until < SPAN else ""),
             **LOADER, kind="pss")


def room(available: int, loader: str = "train") -> tuple[str, str]:
    """The least memory the trainer's container had left while the loader's workers ran."""
    return s(cat.WORKER_MEMORY, f"{available}x{SPAN}", **{**LOADER, "loader": loader},
             kind="available")


def alive(active: str = f"2x{SPAN}") -> tuple[str, str]:
    return s(cat.WORKERS_ACTIVE, active, **LOADER)


def growing(per_second: int, available: int = GIB) -> tuple[tuple[str, str], ...]:
    """Two live workers whose private memory grows `per_second` bytes a second, their PSS
    2/3 as fast (copy-on-read), with `available` bytes of room."""
    return (private_growth(per_second), pss(per_second * 40), alive(), room(available))


IDLE_GPU = (s(cat.GPU_UTILIZATION, "0.3x30", **GPU0),)
BUSY_GPU = (s(cat.GPU_UTILIZATION, "0.9x30", **GPU0),)
# Kubernetes: the sidecar has no NVML; dcgm-exporter labels the pod's GPU (in percent).
POD_LOADER = {**POD, "job": "llm", "container": "dataloader-exporter", "loader": "train",
              "rank": "0"}
POD_STALL = (s(cat.TIME, "0+30x30", "_sum", **POD_LOADER, phase=cat.PHASE_FETCH),
             s(cat.STEP, "0+30x30", "_sum", **POD_LOADER))


def dcgm_gpu(percent: int) -> tuple[tuple[str, str], ...]:
    return ((selector(dcgm.GPU_UTIL, gpu="0", job="dcgm-exporter", namespace=POD["namespace"],
                      pod=POD["pod"]), f"{percent}x30"),)

def ranks(fetch: list[float], step: list[float]) -> tuple[tuple[str, str], ...]:
    """Ranks of one job (480 batches a minute each) waiting fetch[r] and stepping step[r]
    seconds a minute; in step, so fetch + step is the same for every rank."""
    out: tuple[tuple[str, str], ...] = ()
    for r, (f, st) in enumerate(zip(fetch, step, strict=True)):
        lr = {**JOB_RANK, "instance": f"llm-{r}:9478", "rank": str(r)}
        out += (s(cat.TIME, f"0+{f}x30", "_sum", **lr, phase=cat.PHASE_FETCH),
                s(cat.STEP, f"0+{st}x30", "_sum", **lr), s(cat.BATCHES, "0+480x30", **lr))
    return out


JOB_RANK = {"job": "llm", "namespace": "team-a", "loader": "train"}
# Two ranks of a real job: rank 1 waits 21.7 ms a batch for input, rank 0 2.5 ms and the rest
# of the 42.5 ms batch in its all-reduce (seconds a minute at 480 batches a minute).
TWO = ranks([1.2, 10.4], [19.2, 10.0])
EIGHT_ONE_SLOW = ranks([1.0] * 5 + [30.0] + [1.0] * 2, [59.0] * 5 + [30.0] + [59.0] * 2)
EIGHT_EVEN = ranks([1.0, 1.2, 0.8, 1.1, 0.9, 1.0, 1.3, 0.7], [59.0] * 8)
EIGHT_ALL_STARVED = ranks([30.0, 31.0, 29.0, 30.0, 30.5, 29.5, 30.0, 30.0], [30.0] * 8)

CASES: tuple[Case, ...] = (
    Case("DataLoaderInputStraggler", "fires on the one slow rank of eight, and only on it",
         EIGHT_ONE_SLOW, "15m", fires({**JOB_RANK, "rank": "5"})),
    Case("DataLoaderInputStraggler", "fires on the slow rank of two (the issue's figures)",
         TWO, "15m", fires({**JOB_RANK, "rank": "1"})),
    Case("DataLoaderInputStraggler", "stays quiet on eight balanced ranks", EIGHT_EVEN, "15m"),
    Case("DataLoaderInputStraggler", "stays quiet when every rank starves alike (that is "
         "DataLoaderInputBound)", EIGHT_ALL_STARVED, "15m"),

    Case("DataLoaderInputBound", "fires when the loop waits half the time and the GPU idles",
         stall(30) + IDLE_GPU, "15m", fires(LOADER)),
    Case("DataLoaderInputBound", "fires on stall share alone where there are no GPU metrics",
         stall(30), "15m", fires(LOADER)),
    Case("DataLoaderInputBound", "stays quiet while the GPU is busy anyway",
         stall(30) + BUSY_GPU, "15m"),
    Case("DataLoaderInputBound", "stays quiet at a 9% stall share", stall(3) + IDLE_GPU, "15m"),
    Case("DataLoaderInputBound", "stays quiet in Kubernetes while dcgm-exporter shows the "
         "pod's GPU busy", POD_STALL + dcgm_gpu(90), "15m"),
    Case("DataLoaderInputBound", "fires in Kubernetes while dcgm-exporter shows the pod's "
         "GPU idle", POD_STALL + dcgm_gpu(30), "15m", fires(POD_LOADER)),

    Case("DataLoaderEpochStartStall", "fires when an epoch's first batch takes 30 s",
         first_batch(30), "15m", fires(LOADER)),
    Case("DataLoaderEpochStartStall", "fires at 3 s against a 5 ms median batch wait",
         first_batch(3, median_5ms=True), "15m", fires(LOADER)),
    Case("DataLoaderEpochStartStall", "stays quiet under a second even at 100x the median",
         first_batch(0.5, median_5ms=True), "15m"),

    Case("DataLoaderShmNearlyFull", "fires at 95% for 5 minutes", shm(950), "5m", fires(SHM)),
    Case("DataLoaderShmNearlyFull", "stays quiet at 50%", shm(500), "5m"),
    Case("DataLoaderShmFull", "fires at 99% for 5 minutes", shm(990), "5m", fires(SHM)),
    Case("DataLoaderShmFull", "stays quiet at 95%", shm(950), "5m"),

    Case("DataLoaderWorkerLost", "fires with cause unknown when a trainer that records no "
         "causes counts a worker lost",
         workers(active="2x5 1x10", lost="0x5 1x10"), "8m", fires({**LOADER, "cause": "unknown"})),
    Case("DataLoaderWorkerLost", "fires with cause unknown when the trainer records causes but "
         "observed none", workers(active="2x5 1x10", lost="0x5 1x10") + failures(), "8m",
         fires({**LOADER, "cause": "unknown"})),
    Case("DataLoaderWorkerLost", "names the cause the trainer observed (oom), and only it",
         workers(active="2x5 1x10", lost="0x5 1x10") + failures(oom="0x5 1x10"), "8m",
         fires({**LOADER, "cause": "oom"})),
    Case("DataLoaderWorkerLost", "names each cause when workers died of two (crash, killed)",
         workers(active="2x5 0x10", lost="0x5 2x10") + failures(crash="0x5 1x10",
                                                                killed="0x5 1x10"), "8m",
         fires({**LOADER, "cause": "crash"}, {**LOADER, "cause": "killed"})),
    Case("DataLoaderWorkerLost", "fires for a cause whose series first shows up at 1 (the "
         "trainer failed within a scrape of it): no increase() to see",
         workers(active="2x5 1x10", lost="_x5 1x10") + failures(oom="_x5 1x10"), "8m",
         fires({**LOADER, "cause": "oom"})),
    Case("DataLoaderWorkerLost", "stays quiet once such a series is 10 minutes old",
         workers(active="1x25", lost="1x25") + failures(oom="1x25"), "20m"),
    Case("DataLoaderWorkerLost", "fires for a batch that did not fit in /dev/shm (shm), though "
         "no worker died", workers(active="2x15") + failures(shm="0x5 1x10"), "8m",
         fires({**LOADER, "cause": "shm"})),
    Case("DataLoaderWorkerLost", "stays quiet when only the dataset raised (error: the loop "
         "gets the exception)", workers(active="2x15") + failures(error="0x5 1x10"), "8m"),
    Case("DataLoaderWorkerLost", "stays quiet when a worker's IterableDataset shard runs out "
         "mid-epoch (1 of 2 alive while batches flow, none lost)",
         workers(active="2x5 1x10"), "10m"),
    Case("DataLoaderWorkerLost", "stays quiet 10 minutes after the loss",
         workers(active="2x15", lost="0x2 1x13"), "14m"),
    Case("DataLoaderWorkerLost", "stays quiet between epochs without persistent workers",
         workers(active="0x15", last_batch="60x15"), "10m"),

    Case("DataLoaderWorkersCpuStarved", "fires when workers wait for a CPU half their time "
         "while the loop waits half of its", stall(30) + worker_time(40, 60, 20), "15m",
         fires(LOADER)),
    Case("DataLoaderWorkersCpuStarved", "stays quiet while the loop is not input-bound (9%)",
         stall(3) + worker_time(40, 60, 20), "15m"),
    Case("DataLoaderWorkersCpuStarved", "stays quiet when starved workers get their CPU "
         "(running or blocked, 10% waiting)", stall(30) + worker_time(60, 12, 48), "15m"),
    Case("DataLoaderWorkersCpuStarved", "stays quiet without /proc figures (not Linux)",
         stall(30), "15m"),

    Case("DataLoaderStalled", "fires after 9 minutes without a batch from a live trainer",
         (s(cat.LAST_BATCH, "60x15", **LOADER), s(cat.SNAPSHOT_AGE, "1x15", **HOST)), "10m",
         fires({**HOST, "rank": "0"})),
    Case("DataLoaderStalled", "stays quiet while another loader of the rank hands out batches",
         (s(cat.LAST_BATCH, "60x15", **LOADER),
          s(cat.LAST_BATCH, "0+60x15", **{**LOADER, "loader": "val"}),
          s(cat.SNAPSHOT_AGE, "1x15", **HOST)), "10m"),
    Case("DataLoaderStalled", "stays quiet when the trainer is gone (stale snapshots)",
         (s(cat.LAST_BATCH, "60x15", **LOADER), s(cat.SNAPSHOT_AGE, "0+60x15", **HOST)), "10m"),

    Case("DataLoaderExporterDown", "fires when the scrape fails for 5 minutes",
         ((f'up{{instance="{HOST["instance"]}",job="{EXPORTER_JOB}"}}', "0x10"),), "5m",
         fires(HOST)),
    Case("DataLoaderExporterDown", "fires for a Kubernetes sidecar, whose job is the training's",
         ((f'up{{container="{EXPORTER_CONTAINER}",instance="{POD["instance"]}",job="llm",'
           f'namespace="{POD["namespace"]}",pod="{POD["pod"]}"}}', "0x10"),), "5m",
         fires({**POD, "job": "llm", "container": EXPORTER_CONTAINER})),
    Case("DataLoaderExporterDown", "stays quiet while scrapes succeed",
         ((f'up{{instance="{HOST["instance"]}",job="{EXPORTER_JOB}"}}', "1x10"),), "5m"),

    Case("DataLoaderSnapshotsStale", "fires when only stale snapshot files remain",
         snapshot_files(fresh=0, stale=1), "5m", fires(HOST)),
    Case("DataLoaderSnapshotsStale", "fires when the newest snapshot is no longer rewritten",
         (*snapshot_files(fresh=1, stale=0), s(cat.SNAPSHOT_AGE, "0+60x10", **HOST)), "5m",
         fires(HOST)),
    Case("DataLoaderSnapshotsStale", "stays quiet with an old run's file next to a live one",
         (*snapshot_files(fresh=1, stale=1), s(cat.SNAPSHOT_AGE, "1x10", **HOST)), "5m"),

    Case("DataLoaderGpuCollectorDown", "fires when NVML cannot be read for 10 minutes",
         (s(cat.COLLECTOR_UP, "0x10", **HOST, collector=cat.GPU),), "10m",
         fires({**HOST, "collector": cat.GPU})),
    Case("DataLoaderGpuCollectorDown", "stays quiet when only another collector is down",
         (s(cat.COLLECTOR_UP, "1x10", **HOST, collector=cat.GPU),
          s(cat.COLLECTOR_UP, "0x10", **HOST, collector=cat.SHM)), "10m"),

    Case("DataLoaderHostMemoryPressure", "fires with 5% of memory available",
         memory(50, "0x15"), "10m", fires(HOST)),
    Case("DataLoaderHostMemoryPressure", "fires when swap is in use and growing",
         memory(500, "0+1000x15"), "10m", fires(HOST)),
    Case("DataLoaderHostMemoryPressure", "stays quiet when swap is in use but flat",
         memory(500, "1000x15"), "10m"),

    Case("DataLoaderWorkerMemoryGrowth", "fires when private memory grows 1 MiB/s with 1 GiB "
         "left (21 GiB in 6 hours)", growing(MIB), "40m", fires(LOADER)),
    Case("DataLoaderWorkerMemoryGrowth", "fires when 64 KiB/s would outgrow 1 GiB left within "
         "6 hours (1.3 GiB)", growing(64 * 1024), "40m", fires(LOADER)),
    Case("DataLoaderWorkerMemoryGrowth", "fires with one worker whose PSS grows half as fast "
         "as its private memory",
         (private_growth(MIB), pss(MIB * 30), alive(f"1x{SPAN}"), room(GIB)), "40m",
         fires(LOADER)),
    Case("DataLoaderWorkerMemoryGrowth", "stays quiet at 64 KiB/s with 2 GiB left",
         growing(64 * 1024, 2 * GIB), "40m"),
    Case("DataLoaderWorkerMemoryGrowth", "stays quiet when PSS is flat under a growth still "
         "exported (stale)", (private_growth(MIB), pss(0), alive(), room(GIB)), "40m"),
    Case("DataLoaderWorkerMemoryGrowth", "stays quiet when PSS rises far slower than the "
         "growth exported (16 KiB/s against 1 MiB/s)",
         (private_growth(MIB), pss(16 * 1024 * 60), alive(), room(GIB)), "40m"),
    Case("DataLoaderWorkerMemoryGrowth", "stays quiet once the workers ended (the growth and "
         "the room kept; PSS rising before their end)",
         (private_growth(MIB), pss(MIB * 40, until=20), alive(f"2x20 0x{SPAN - 20}"),
          room(GIB)), "40m"),
    Case("DataLoaderWorkerMemoryGrowth", "stays quiet when one loader grows and only another "
         "reports little room", (private_growth(MIB), pss(MIB * 40), alive(),
                                 room(64 * MIB, loader="val")), "40m"),
    Case("DataLoaderWorkerMemoryGrowth", "stays quiet while no growth is exported (not yet "
         "measured)", (pss(MIB * 40), alive(), room(64 * MIB)), "40m"),
)
