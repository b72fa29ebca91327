"""Why the input is slow: where the loader's workers spend their wall time, what bounds
them, and the number of workers and the queue depth that follow.

The trainer splits the workers' wall time, summed over live workers, into running on a
CPU, waiting for one (the run-queue delay of /proc/<pid>/schedstat) and blocked (the
rest: storage, the network, a lock, a full queue or sleep). That split says why only
while the training loop waits for input: otherwise blocked time is mostly workers idle
on a full queue, and the bottleneck is "none". While it waits:

- workers that swap, or whose next worker would not fit in memory, are bound by memory;
- workers that wait for a CPU bands.CPU_CONTENTION of their time or more are too many for the
  cores they get (more workers than cores, or other processes on them): fewer;
- otherwise the larger of running and blocked decides: running is CPU-bound work (more
  workers only where cores are free, else cheaper samples or more cores); blocked waits
  on something else (more workers overlap it, within the storage's cap and the cores
  their running share needs; a deeper queue, caching or faster storage).

Absent figures (no workers, or not Linux) give "unknown", and nothing is drawn from them.
Every advice to add workers is capped by memory at the measured per-worker memory (PSS
where the trainer reads it, else RSS, which counts copy-on-write pages in every worker
and so errs high); while the workers' private memory is seen to grow, each worker's is
projected to include what it has yet to copy of the dataset's largest container (NOTE
[ copy-on-read ] in diagnosis.memgrowth).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dataloader_exporter.core import advisor, bands
from dataloader_exporter.core.tuner.model import Load, choose
from dataloader_exporter.diagnosis import memgrowth
from dataloader_exporter.diagnosis.machine import Machine
from dataloader_exporter.diagnosis.signals import LoaderSignals
from dataloader_exporter.diagnosis.units import gib, pct
from dataloader_exporter.diagnosis.workersignals import DatasetContainer

MiB = float(1 << 20)
# Growth of the workers' swap in a window: a few pages swapped out are noise, a MiB paging.
SWAP_GROWTH = MiB

CPU, CONTENTION, BLOCKED, MEMORY, NONE, UNKNOWN = (
    "cpu", "cpu_contention", "blocked", "memory", "none", "unknown")
BOTTLENECKS = (CPU, CONTENTION, BLOCKED, MEMORY, NONE, UNKNOWN)
CHEAPER = ("make samples cheaper (decode or augment less, cache decoded samples, move "
           "augmentation to the GPU) or give the job more cores")


@dataclass
class WorkerView:
    """A diagnosis's `workers`: shares of the workers' wall time in the window, memory per
    live worker, the bottleneck and the sentence that says why. None: unknown."""

    running_share: float | None = None
    waiting_for_cpu_share: float | None = None
    blocked_share: float | None = None
    rss_bytes: float | None = None  # per live worker: PSS where known, else RSS
    # which rss_bytes is: "pss" or "rss" of the live workers, or "peak_rss" (none alive)
    memory_kind: str | None = None
    bottleneck: str = UNKNOWN
    why: str = ""
    live_workers: float | None = None
    cpu_cores_used: float | None = None  # running seconds per second: the cores they got
    swap_bytes: float | None = None
    max_rss_bytes: float | None = None
    read_storage_bytes_per_second: float | None = None
    read_bytes_per_second: float | None = None  # any read(): page cache and network too
    major_faults_per_second: float | None = None
    memory_room_bytes: float | None = None  # what more workers may take, reserve kept
    # "trainer" (what the trainer's container could still allocate while it worked, its
    # own figure), else "cgroup" (the exporter's container's limit) or "host" (MemAvailable)
    memory_room_source: str | None = None
    more_workers_memory_allows: int | None = None
    swapping: bool = False  # the workers' swap grows (or the host's, with theirs in it)
    private_growth_bytes_per_second: float | None = None  # per worker (memgrowth)
    # bytes each worker is projected to copy yet of the dataset's largest container,
    # counted in the memory cap (None: no growth seen, or no container)
    copy_left_bytes: float | None = None
    dataset_containers: tuple[DatasetContainer, ...] = ()  # the largest first


def _rate(x: float | None, seconds: float) -> float | None:
    return None if x is None or seconds <= 0 else x / seconds


def memory_room(s: LoaderSignals, machine: Machine, reserve: float = bands.MEMORY_RESERVE
                ) -> tuple[float, str] | None:
    """Memory more workers may take, keeping `reserve` of the total free: the tighter of
    the container's limit (when the exporter reports its cgroup) and the host's
    available; with no reserve, the memory left before the OOM killer."""
    if s.workers.available is not None:  # the trainer's own container, while it worked
        total = s.memory_total or machine.memory_total or 0
        return max(0.0, s.workers.available - reserve * total), "trainer"
    options = []
    if s.cgroup_limit and s.cgroup_usage is not None:
        options.append((s.cgroup_limit * (1 - reserve) - s.cgroup_usage, "cgroup"))
    available = s.memory_available if s.memory_available is not None else \
        machine.memory_available
    total = s.memory_total or machine.memory_total
    if available is not None and total:
        options.append((available - reserve * total, "host"))
    if not options:
        return None
    room, where = min(options)
    return max(0.0, room), where


def view(s: LoaderSignals, machine: Machine, starved: bool) -> WorkerView:
    """The workers' figures and their bottleneck before any advice (see advise)."""
    w = s.workers
    v = WorkerView(live_workers=s.workers_active, swap_bytes=w.swap, max_rss_bytes=w.max_rss,
                   dataset_containers=s.dataset_containers,
                   private_growth_bytes_per_second=memgrowth.per_worker(s),
                   read_storage_bytes_per_second=_rate(w.storage, s.seconds),
                   read_bytes_per_second=_rate(w.syscalls, s.seconds),
                   major_faults_per_second=_rate(w.major_faults, s.seconds),
                   cpu_cores_used=_rate(w.running, s.seconds))
    total = w.seconds
    if total and w.running is not None and w.waiting_for_cpu is not None and \
            w.blocked is not None:
        v.running_share, v.waiting_for_cpu_share, v.blocked_share = (
            w.running / total, w.waiting_for_cpu / total, w.blocked / total)
    live = s.workers_active
    memory = w.pss if w.pss is not None else w.rss
    if memory is not None and live:
        v.rss_bytes, v.memory_kind = memory / live, "pss" if w.pss is not None else "rss"
    elif w.max_rss:  # no worker alive now (a run that ended): the most any worker held
        v.rss_bytes, v.memory_kind = w.max_rss, "peak_rss"
    room = memory_room(s, machine)
    if room is not None:
        v.memory_room_bytes, v.memory_room_source = room
        if v.rss_bytes:
            # Copy-on-read: each worker, a new one too, is still to copy this much, and
            # the live ones take it from the same room (projected, not held now).
            left = memgrowth.still_to_copy(s)
            v.copy_left_bytes = left or None
            free = max(0.0, room[0] - (live or 0.0) * left)
            v.more_workers_memory_allows = math.floor(free / (v.rss_bytes + left))
    v.swapping = bool(w.swap) and ((w.swap_growth or 0.0) > SWAP_GROWTH or
                                   s.swap_growth > SWAP_GROWTH)
    v.bottleneck, v.why = _bottleneck(v, s, starved)
    return v


def unknown(rank: str, workers: int | None) -> str:
    """The `unknowns` line of a rank whose bottleneck is unknown: why, and what would tell."""
    return f"rank {rank}: why the input is slow is unknown: " + (
        "the loader has no workers (num_workers=0)" if workers == 0 else
        "no worker time figures; /proc figures (Linux) from a loader with workers would tell")


def _bottleneck(v: WorkerView, s: LoaderSignals, starved: bool) -> tuple[str, str]:
    w = s.workers
    if not starved:
        return NONE, "the loop does not wait for input"
    if v.swapping and w.swap:
        each = f"; each worker holds {gib(v.rss_bytes)} ({_kind(v)})" if v.rss_bytes else ""
        return MEMORY, (f"the workers swap ({gib(w.swap)} of theirs in swap, growing): memory, "
                        f"not CPU, is the limit{each}; use fewer workers or a lower "
                        "prefetch_factor, and datasets that share memory (numpy arrays or "
                        "tensors, not lists of Python objects)")
    if v.running_share is None or v.waiting_for_cpu_share is None or v.blocked_share is None:
        return UNKNOWN, ("where the workers' time goes is unknown: no /proc figures (Linux) "
                         "from a loader with workers")
    if v.waiting_for_cpu_share >= bands.CPU_CONTENTION:
        return CONTENTION, (f"the workers wait for a CPU {pct(v.waiting_for_cpu_share)} of "
                            "their time: more workers than the cores they get, other "
                            "processes on those cores, or (on a virtual machine) a busy "
                            "host taking them")
    if v.running_share >= v.blocked_share:
        return CPU, f"the workers run {pct(v.running_share)} of their time: the samples cost CPU"
    return BLOCKED, (f"the workers are blocked {pct(v.blocked_share)} of their time while the "
                     "loop waits: on storage, the network, a lock or sleep" + _reads(v))


def memory_kind(v: WorkerView) -> str:
    """How the per-worker memory was read, in words for the report."""
    return _kind(v)


def _kind(v: WorkerView) -> str:
    return {"peak_rss": "the largest RSS a worker had"}.get(v.memory_kind or "",
                                                            (v.memory_kind or "").upper())


def _reads(v: WorkerView) -> str:
    """What they read, as a hint at what blocks them (never a claim of I/O unseen)."""
    if v.read_bytes_per_second is None:
        return ""
    if v.read_bytes_per_second < MiB:
        return " (they read under 1 MiB/s)"
    disk = ("" if v.read_storage_bytes_per_second is None else
            f", {gib(v.read_storage_bytes_per_second)}/s of it from storage")
    return f" (they read {gib(v.read_bytes_per_second)}/s{disk})"


@dataclass(frozen=True)
class Advice:
    """num_workers for one rank, why, and what could not be checked."""

    workers: int
    why: str
    unknown: str = ""


def advise(v: WorkerView, s: LoaderSignals, workers: int, starved: bool, machine: Machine,
           local_ranks: int, cuda: bool) -> Advice:
    """num_workers as the bottleneck says (none or unknown: the config-based advisor), then
    never more than memory allows; a bottleneck that memory binds becomes MEMORY."""
    cores = advisor.worker_cores(machine.cpu, local_ranks, cuda)
    n_cores = f"{cores} core{'' if cores == 1 else 's'} per local rank"
    if v.bottleneck == CONTENTION:
        if workers <= 1:
            v.why += "; other processes take the cores: give the job more cores"
            return Advice(workers, v.why)
        got = max(1, min(cores, round(v.cpu_cores_used or 0.0)))
        return Advice(min(got, workers - 1), (
            f"{v.why}; they get about {v.cpu_cores_used or 0:.1f} cores' worth between them "
            f"({n_cores}), and more workers only queue for them"))
    if v.bottleneck == MEMORY:
        per = v.rss_bytes or 0.0
        drop = max(1, math.ceil((v.swap_bytes or 0.0) / per)) if per else 1
        return Advice(max(1, workers - drop) if workers > 1 else workers, v.why)
    cpus = machine.cpu.usable / max(1, local_ranks)
    if v.bottleneck == CPU:
        target = modelled(v, s, cpus)
        target = cores if target is None else target
        if workers >= target:
            v.why += f"; no core is free for another worker ({n_cores}): {CHEAPER}"
            return Advice(workers, v.why)
        advice = Advice(target, f"{v.why}, and {max(0, cores - workers)} of the {n_cores} "
                                "are free")
    elif v.bottleneck == BLOCKED:
        busy = (v.running_share or 0.0) + (v.waiting_for_cpu_share or 0.0)
        # The tuner's model, its first move from these figures: one answer for the same
        # figures (a local disk that saturates shows in the tuner's trial, not here).
        target = modelled(v, s, cpus)
        limit = "the tuner's model: the cores their CPU and the loop's need, or the loop's pace"
        if target is None:  # without the figures: the cores their CPU needs, capped
            cap = advisor.blocked_cap(machine.cpu, local_ranks, cuda, machine.storage)
            target = min(cap, math.floor(cores / busy) if busy > 0 else cap)
            limit = f"the cap for {machine.storage} storage or the {n_cores}"
        if target <= workers:
            v.why += (f"; more workers would pass {limit}: a deeper prefetch_factor, caching "
                      "or faster storage")
            return Advice(workers, v.why)
        advice = Advice(target, f"{v.why}; more workers overlap the waits (each needs "
                                f"{pct(busy)} of a core; {n_cores}, {machine.storage} storage)")
    elif workers == 0 and starved and (load := loop_load(s)) is not None:
        target = choose(load, cpus)
        advice = Advice(target, f"the loop waits for data {pct(s.stall_share)} of the time: "
                                f"without workers {load.line()} (the loop thread's CPU time "
                                f"counted as the fetch's first); the tuner's model gives "
                                f"{target} for {cpus:g} cores")
        if target == 0:
            advice = _configured(s, workers, starved, machine, local_ranks, cuda, n_cores)
    else:
        advice = _configured(s, workers, starved, machine, local_ranks, cuda, n_cores)
    return _memory_cap(v, s, workers, advice)


def loop_load(s: LoaderSignals) -> Load | None:
    """A loader without workers, per batch: the fetch and the step the loop's thread
    timed, and its CPU time in them, not split between the two: counted as the fetch's
    first (up to its wall time), so a blocked fetch is never read as more blocked than it
    was, and the step counted as CPU whole (as in modelled); None when a figure is
    missing."""
    if not s.batches or not s.fetch_seconds or s.loop_cpu_seconds is None:
        return None
    fetch, step = s.fetch_seconds / s.batches, s.step_seconds / s.batches
    return Load(fetch, min(fetch, s.loop_cpu_seconds / s.batches), step)


def modelled(v: WorkerView, s: LoaderSignals, cpus: float) -> int | None:
    """The worker count the tuner's model (core/tuner/model.py) chooses from this window's
    figures: per batch, the workers' running and blocked seconds and the step's (all of
    it counted as CPU: the trainer's own CPU time is not exported); None when a figure is
    missing."""
    if (not s.batches or not s.seconds or not v.running_share or v.blocked_share is None
            or v.cpu_cores_used is None):
        return None
    running = v.cpu_cores_used * s.seconds  # the workers' CPU seconds in the window
    busy = running / v.running_share * (v.running_share + v.blocked_share)
    load = Load(busy / s.batches, running / s.batches, s.step_seconds / s.batches)
    return choose(load, cpus)


def _configured(s: LoaderSignals, workers: int, starved: bool, machine: Machine,
                local_ranks: int, cuda: bool, n_cores: str) -> Advice:
    """The advisor's count from the configuration, cores and storage alone."""
    n = advisor.advised_workers(workers, starved, machine.cpu, local_ranks, cuda,
                                machine.storage)
    spare = "" if cuda else ", keeping a core for the training loop, which runs on the CPU"
    share = (f"{machine.cpu.describe()} shared by {local_ranks} local rank"
             f"{'' if local_ranks == 1 else 's'}")
    if n > workers:
        return Advice(n, f"the loop waits for data {pct(s.stall_share)} of the time and "
                         f"{n_cores} can load in parallel ({share}; storage: "
                         f"{machine.storage}{spare})")
    return Advice(n, f"more workers than the {n_cores} ({share}{spare}) only fight for CPU")


def _memory_cap(v: WorkerView, s: LoaderSignals, workers: int, advice: Advice) -> Advice:
    if advice.workers <= workers:
        return advice
    allowed = v.more_workers_memory_allows
    if allowed is None:
        return Advice(advice.workers, advice.why, (
            f"rank {s.rank}: the advice to add workers is not checked against memory: the "
            "memory per worker is unknown (/proc figures, Linux, from a loader with workers)"
            if v.rss_bytes is None else f"rank {s.rank}: the advice to add workers is not "
            "checked against memory: the memory available is unknown"))
    if workers + allowed >= advice.workers:
        return advice
    source = {"trainer": "the least the trainer's container could still allocate while its "
                         "workers ran",
              "cgroup": "the container's memory limit less its usage"}.get(
        v.memory_room_source or "", "the host's available memory")
    copying = (f" and is still to copy about {gib(v.copy_left_bytes)} of "
               f"`{v.dataset_containers[0].attribute}` (copy-on-read)"
               if v.copy_left_bytes and v.dataset_containers else "")
    limit = (f"memory, not CPU, is the limit: each worker holds {gib(v.rss_bytes or 0.0)} "
             f"({_kind(v)}){copying}; {gib(v.memory_room_bytes or 0.0)} available allows "
             f"{allowed} more ({source}, keeping {pct(bands.MEMORY_RESERVE)} of the total free)")
    if allowed == 0 and v.bottleneck in (CPU, BLOCKED):  # not one more worker fits
        v.bottleneck, v.why = MEMORY, f"{v.why}; {limit}"
    return Advice(workers + allowed, f"{advice.why}; {limit}")


def prefetch(v: WorkerView, s: LoaderSignals, starved: bool, workers: int, eff_workers: int,
             current: int, memory_risk: bool) -> tuple[int, str, str]:
    """prefetch_factor, why (empty: no advice, drawn from nothing known), and what is not
    known; memory_risk: /dev/shm or memory ran out, or would."""
    busy = s.worker_cpu_share
    if current > 1 and ((v.swapping and v.bottleneck == MEMORY) or memory_risk):
        return max(1, current // 2), ("fewer batches in flight keep /dev/shm and memory "
                                      "within bounds"), ""
    if v.bottleneck == BLOCKED or (v.bottleneck == MEMORY and not v.swapping and (
            v.blocked_share or 0.0) > (v.running_share or 0.0)):  # no room for a worker
        return max(4, current), (f"workers are blocked {pct(v.blocked_share)} of their time "
                                 "while the loop waits: a deeper queue per worker hides slow "
                                 "reads"), ""
    if v.bottleneck in (CPU, CONTENTION):
        return current, "a deeper queue does not make samples cheaper to compute", ""
    if starved and workers and busy is None:  # how busy the workers are is unknown
        return current, "", ("worker busy time unknown (no per-worker figures): no advice on "
                             "prefetch_factor from it")
    if starved and eff_workers and busy is not None and busy < 0.7 and workers:
        return max(4, current), (f"workers use only {pct(busy)} of a core each yet the loop "
                                 "waits: samples wait on I/O or cost unevenly, and a deeper "
                                 "queue hides that"), ""
    return current, "the default queue of two batches per worker is enough here", ""
