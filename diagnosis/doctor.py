"""The doctor: turns a window of loader signals and the machine's facts into a diagnosis.

Verdicts use the input-bound bands of TensorFlow's profiler (stall share = time waiting
for data / (waiting + computing)): 20% and above is input-bound, 5-20% moderately, under
5% not, judged on the whole percent the report prints, so a verdict never changes while
its figure stays the same. Every recommendation carries the one sentence that says why,
and none is drawn from a figure that is missing. Across ranks (diagnosis.job_signals)
the job's stall is the slowest input's; an input straggler gets the advice, and the
ranks that only wait for it get none about their own loader. Why the input is slow, and
the number of workers that follows, comes from where the workers' time goes
(diagnosis.why); why workers failed, from the causes the trainer observed
(diagnosis.failure_advice); why their memory grows, from the dataset's largest
container (diagnosis.memgrowth). A loader the loader tuner still tunes gets no advice on
num_workers or prefetch_factor: the tuner sets them (diagnosis.tuner_report).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dataloader_exporter.core import advisor, bands
from dataloader_exporter.diagnosis import failure_advice, memgrowth, tuner_report, why
from dataloader_exporter.diagnosis.job_signals import Job, RankTimes, points, rank_times
from dataloader_exporter.diagnosis.machine import Machine
from dataloader_exporter.diagnosis.signals import LoaderSignals
from dataloader_exporter.diagnosis.units import gib, ms, pct

FIRST_BATCH_FACTOR = 10.0  # a first batch this many times the median wait is a stall
FIRST_BATCH_MIN = 0.5  # seconds: shorter first batches are not worth a finding
STORAGE_WORKERS = advisor.STORAGE_WORKERS

# Memory or /dev/shm ran out (no more workers), or would (a shallower queue too).
RAN_OUT = ("failure-oom", "failure-shm")
MEMORY_FINDINGS = ("shm-risk", "host-memory-risk", *RAN_OUT)
# No more workers either while the workers' memory grows: each added one would grow too
# (copy the dataset's objects). Its queue stays: batches in flight are not what grows.
NO_MORE_WORKERS = (*RAN_OUT, memgrowth.KIND)
STARVED = ("input-bound", "moderately input-bound")  # the loop waits for input
VERDICTS = {"input-bound": "INPUT-BOUND", "moderately input-bound": "MODERATELY INPUT-BOUND",
            "not input-bound": "NOT INPUT-BOUND", "idle": "IDLE"}


@dataclass
class Finding:
    # epoch-start-stall, ended-abruptly, lost-workers, failure-<cause>, shm-risk,
    # host-memory-risk, swap, workers-swap, memory-growth, input-straggler,
    # waits-for-straggler
    kind: str
    message: str


@dataclass
class Recommendation:
    setting: str
    value: str
    current: str
    why: str


@dataclass
class Diagnosis:
    loader: str
    rank: str
    verdict: str
    figures: dict[str, float | None]
    findings: list[Finding] = field(default_factory=list)
    recommendations: list[Recommendation] = field(default_factory=list)
    unknowns: list[str] = field(default_factory=list)  # what could not be judged, and why
    workers: why.WorkerView = field(default_factory=why.WorkerView)
    failures: list[dict[str, object]] = field(default_factory=list)  # causes seen, fixes
    tuner: tuner_report.TunerView | None = None  # None: the loader tuner does not tune it

    @property
    def healthy(self) -> bool:
        return self.verdict in ("not input-bound", "idle") and not self.findings


def verdict(stall: float | None, batches: float) -> str:
    """The band of the stall share as printed (whole percent)."""
    if stall is None or batches <= 0:
        return "idle"
    pct = points(stall)
    if pct >= points(bands.INPUT_BOUND):
        return "input-bound"
    if pct >= points(bands.MODERATE):
        return "moderately input-bound"
    return "not input-bound"


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text not in (None, "") else None
    except ValueError:
        return None


def _flag(text: str | None) -> bool | None:
    return {"true": True, "false": False}.get((text or "").lower())


def diagnose(s: LoaderSignals, machine: Machine, local_ranks: int = 1,
             job: Job | None = None) -> Diagnosis:
    """The diagnosis of one (loader, rank); `job` is its loader across the job's ranks."""
    stall = s.stall_share
    times = rank_times(s)
    waiting = job.waiting.get(s.rank) if job else None
    room = why.memory_room(s, machine, reserve=0.0)  # left before the OOM killer
    d = Diagnosis(s.loader, s.rank, verdict(stall, s.batches), {
        "stall_share": stall, "batches_per_second": s.batches_per_second,
        "samples_per_second": s.samples_per_second, "fetch_p50_seconds": s.fetch_p50,
        "fetch_p95_seconds": s.fetch_p95, "first_batch_seconds": s.first_batch_mean,
        "median_wait_seconds": s.median_wait, "worker_cpu_share": s.worker_cpu_share,
        "workers_configured": s.workers_configured, "workers_active": s.workers_active,
        "batch_bytes": s.batch_bytes, "gpu_utilization": s.gpu_utilization,
        "window_seconds": s.seconds, "batches": s.batches, "samples": s.samples,
        "local_ranks": float(local_ranks),
        "worker_private_growth_bytes_per_second": s.workers.private_growth,
        "workers_memory_left_seconds": memgrowth.seconds_left(s, room),
        "fetch_per_batch_seconds": times.fetch if times else None,
        "step_per_batch_seconds": times.step if times else None,
        "waiting_for_other_ranks_seconds_per_batch": waiting})
    cfg = _config(s)
    d.tuner = tuner_report.view(s.tuner, s.config)
    d.workers = why.view(s, machine, d.verdict in STARVED)
    if d.workers.bottleneck == why.UNKNOWN:
        d.unknowns.append(why.unknown(s.rank, cfg.workers))
    _findings(d, s, cfg, machine, local_ranks, room)
    if job and job.stragglers:
        if s.rank not in job.straggler_ranks:
            starving = d.verdict == "input-bound"
            d.findings.append(_waits(job, s.rank, times, starving))
            if not starving:
                return d  # it mostly waits for the straggler: no advice for its own loader
        else:
            d.findings.append(_straggler(job, s.rank))
    _recommend(d, s, cfg, machine, local_ranks)
    return d


def _straggler(job: Job, rank: str) -> Finding:
    [me] = [x for x in job.stragglers if x.rank == rank]
    others = [w / (w + job.fastest_step_per_batch) for r, w in job.waiting.items()
              if r not in job.straggler_ranks and job.fastest_step_per_batch is not None
              and w + job.fastest_step_per_batch > 0]
    held = f"; the other ranks spend about {pct(sum(others) / len(others))} of their step " \
           "waiting for it" if others else ""
    return Finding("input-straggler", (
        f"input straggler: rank {rank} waits {ms(me.fetch_per_batch)} a batch for input "
        f"against {ms(job.median_fetch_per_batch)} for the median rank, "
        f"{pct(me.excess_share)} of the job's batch period{held}; its loader, storage, "
        "cores and /dev/shm are what to fix"))


def _waits(job: Job, rank: str, times: RankTimes | None, starving: bool) -> Finding:
    wait = job.waiting.get(rank)
    step = times.step if times else None
    them = "them" if len(job.stragglers) > 1 else "it"
    part = (f"about {ms(wait)} of its {ms(step)} step a batch ({pct(wait / step)}) is "
            f"waiting for {them} in the collective, not compute (estimated: its step minus "
            "the fastest rank's)" if wait is not None and step else "its step includes "
            f"waiting for {them} in the collective")
    who = ", ".join(job.straggler_ranks)
    if starving:  # input-bound itself too: its own advice follows
        return Finding("waits-for-straggler", (
            f"waits for rank{'s' if len(job.stragglers) > 1 else ''} {who}: {part}; its own "
            "input is slow too (see its settings)"))
    return Finding("waits-for-straggler", (
        f"waits for rank{'s' if len(job.stragglers) > 1 else ''} {who}: {part}; fix "
        f"rank {who}'s input, not this rank's loader"))


def _shm_total(s: LoaderSignals, machine: Machine) -> float | None:
    """/dev/shm's size as the exporter watches it, else as the trainer saw it (its
    snapshot files read elsewhere), else as this machine has it."""
    if s.shm_size is not None:
        return s.shm_size
    trainer = _int(s.config.get("dev_shm_bytes"))
    return float(trainer) if trainer else machine.shm_size


def _abrupt(s: LoaderSignals) -> str:
    """An ended run whose last snapshot has no normal exit: what that means."""
    workers = (f"; {s.workers_active:g} workers were alive at its last snapshot"
               if s.workers_active else "")
    causes = "" if not s.failures or not any(s.failures.values()) else (
        "; the failures below say what the trainer saw")
    return (f"rank {s.rank}: the run ended without a normal exit: its last snapshot has no "
            "exit time (the process's exit handlers never ran), so it was killed (SIGKILL: "
            "the OOM killer, the scheduler, a node going away), crashed in native code, or "
            f"froze, after {s.batches:g} batches{workers}{causes}")


def _findings(d: Diagnosis, s: LoaderSignals, cfg: _Config, machine: Machine,
              local_ranks: int, room: tuple[float, str] | None) -> None:
    """`room`: the memory left before the OOM killer (why.memory_room, no reserve)."""
    if (s.first_batch_mean is not None and s.first_batch_mean >= FIRST_BATCH_MIN and
            s.first_batch_mean > FIRST_BATCH_FACTOR * (s.median_wait or 0.0)):
        ratio = s.first_batch_mean / s.median_wait if s.median_wait else math.inf
        d.findings.append(Finding("epoch-start-stall", (
            f"epoch-start stall: the first batch of an epoch takes {s.first_batch_mean:.2f} s "
            f"against a median wait of {ms(s.median_wait)} (x{ratio:.0f})")))
    if s.ended and s.exited_at is None and s.batches > 0:
        d.findings.append(Finding("ended-abruptly", _abrupt(s)))
    if s.workers_lost > 0:  # counted only for workers that died while still needed
        d.findings.append(Finding("lost-workers", failure_advice.lost_message(s)))
    in_flight = (bands.shm_in_flight(s.batch_bytes, cfg.prefetch, cfg.workers, local_ranks)
                 if s.batch_bytes and cfg.workers else None)
    shm_total = _shm_total(s, machine)
    d.failures = failure_advice.entries(s, d.workers, failure_advice.Shm(
        shm_total, in_flight, None if in_flight is None else bands.shm_size_advice(in_flight)),
        cfg.workers)
    d.findings += [Finding(f"failure-{f['cause']}", f"{f['seen']}. Fix: {f['fix']}")
                   for f in d.failures]
    if d.workers.bottleneck == why.MEMORY and d.workers.swapping:
        d.findings.append(Finding("workers-swap", d.workers.why))
    if memgrowth.seen(s):
        d.findings.append(Finding(memgrowth.KIND, memgrowth.message(s, room)))
    if s.batch_bytes and in_flight is not None:
        if shm_total is not None and in_flight > shm_total:
            d.findings.append(Finding("shm-risk", (
                f"/dev/shm risk: batches in flight need {gib(in_flight)} "
                f"(batch {gib(s.batch_bytes)} x prefetch {cfg.prefetch} x {cfg.workers} "
                f"workers x {local_ranks} ranks x {bands.SHM_SAFETY}) but /dev/shm holds "
                f"{gib(shm_total)}: expect bus errors")))
        available = (s.memory_available if s.memory_available is not None
                     else machine.memory_available)
        if available and in_flight > available:
            d.findings.append(Finding("host-memory-risk", (
                f"host memory risk: batches in flight need {gib(in_flight)} but only "
                f"{gib(available)} is available")))
    workers_swap = any(f.kind == "workers-swap" for f in d.findings)  # says more
    if s.swap_used and not workers_swap and (s.swap_growth > 0 or (
            s.memory_total and s.memory_available and
            s.memory_available < 0.1 * s.memory_total)):
        d.findings.append(Finding("swap", (
            f"swap in use ({gib(s.swap_used)}) and growing: workers are paging; use fewer "
            "workers or a smaller prefetch_factor")))


@dataclass(frozen=True)
class _Config:
    workers: int | None  # None: unknown (no dataloader_info, no workers gauge)
    prefetch: int
    persistent: bool | None
    pin: bool | None


def _config(s: LoaderSignals) -> _Config:
    cfg = s.config
    workers = _int(cfg.get("num_workers"))
    if workers is None and s.workers_configured is not None:
        workers = int(s.workers_configured)
    return _Config(workers, _int(cfg.get("prefetch_factor")) or 2,
                   _flag(cfg.get("persistent_workers")), _flag(cfg.get("pin_memory")))


def _recommend(d: Diagnosis, s: LoaderSignals, cfg: _Config, machine: Machine,
               local_ranks: int) -> None:
    cuda = s.gpu_utilization is not None
    rec = d.recommendations
    if s.batches <= 0:
        d.unknowns.append("no settings advice: the loader handed out no batch in the window")
        return
    if cfg.workers is None:
        d.unknowns.append("no settings advice: the loader's settings are unknown (no "
                          "dataloader_info or workers gauge in the metrics)")
        return
    if not cuda:
        d.unknowns.append("no GPU metrics: the advice assumes the loop trains on the CPU and "
                          "keeps a core for it (run the sidecar with NVML, or dcgm-exporter)")
    workers, prefetch = cfg.workers, cfg.prefetch
    eff_workers, want_prefetch = _workers_and_queue(d, s, workers, prefetch, machine,
                                                    local_ranks, cuda)
    if d.tuner is not None and d.tuner.held:  # the tuner's to set while it tries them
        held = set(d.tuner.held)
        rec[:] = [r for r in rec if r.setting not in held]
        if "num_workers" in held:
            eff_workers = workers
        if "prefetch_factor" in held:
            want_prefetch = prefetch
    if eff_workers and cfg.persistent is not True:
        if d.tuner is not None and d.tuner.let_go:
            d.unknowns.append("no persistent_workers advice: the loader tuner saw the training "
                              "change the dataset between epochs, which kept workers would "
                              "not see")
        elif "persistent_workers" not in (d.tuner.held if d.tuner is not None else ()):
            rec.append(Recommendation("persistent_workers", "True", str(cfg.persistent), (
                "workers are started again at every epoch otherwise, which stalls its first "
                "batch")))
    if cuda and cfg.pin is not True:
        rec.append(Recommendation("pin_memory", "True", str(cfg.pin), (
            "copies from pinned memory are faster and can overlap compute")))
    if cuda:
        rec.append(Recommendation("non_blocking", "True", "", (
            "with pinned memory, to_device(..., non_blocking=True) lets the copy overlap the "
            "previous step")))
    shm_total = _shm_total(s, machine)
    needed = bands.shm_in_flight(s.batch_bytes or 0, want_prefetch, eff_workers, local_ranks)
    if eff_workers and needed and (shm_total is None or needed > shm_total):
        rec.append(Recommendation("--shm-size", bands.shm_size_advice(needed),
                                  gib(shm_total) if shm_total else "unknown", (
            f"workers hand batches over through /dev/shm and about {gib(needed)} are in "
            "flight; Kubernetes: a memory-backed emptyDir at /dev/shm")))


def _workers_and_queue(d: Diagnosis, s: LoaderSignals, workers: int, prefetch: int,
                       machine: Machine, local_ranks: int, cuda: bool) -> tuple[int, int]:
    """Advice on num_workers and prefetch_factor; returns the workers and queue depth the
    rest of the advice assumes."""
    starved = d.verdict in STARVED
    rec = d.recommendations
    advice = why.advise(d.workers, s, workers, starved, machine, local_ranks, cuda)
    rec_workers = advice.workers
    if rec_workers > workers and any(f.kind in NO_MORE_WORKERS for f in d.findings):
        rec_workers = workers  # memory or /dev/shm ran out at this count, or memory grows
    if advice.unknown:
        d.unknowns.append(advice.unknown)
    if rec_workers != workers:
        rec.append(Recommendation("num_workers", str(rec_workers), str(workers), advice.why))
    eff_workers = max(workers, rec_workers)
    memory_risk = any(f.kind in MEMORY_FINDINGS for f in d.findings)
    want_prefetch, reason, unknown = why.prefetch(d.workers, s, starved, workers, eff_workers,
                                                  prefetch, memory_risk)
    d.unknowns += [unknown] if unknown else []
    if eff_workers and reason:
        rec.append(Recommendation("prefetch_factor", str(want_prefetch), str(prefetch), reason))
    return eff_workers, want_prefetch
