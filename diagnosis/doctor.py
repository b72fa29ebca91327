"""The doctor: turns a window of loader signals and the machine's facts into a diagnosis.

Verdicts use the input-bound bands of TensorFlow's profiler (stall share = time waiting
for data / (waiting + computing)): 20% and above is input-bound, 5-20% moderately, under
5% not. Every recommendation carries the one sentence that says why.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from diagnosis.machine import Machine
from diagnosis.signals import LoaderSignals

INPUT_BOUND = 0.20
MODERATE = 0.05
SHM_SAFETY = 1.5
FIRST_BATCH_FACTOR = 10.0  # a first batch this many times the median wait is a stall
FIRST_BATCH_MIN = 0.5  # seconds: shorter first batches are not worth a finding
STORAGE_WORKERS = {"ssd": 4, "rotational": 4, "nvme": 12, "network": 16}
GiB = 1024**3

VERDICTS = {"input-bound": "INPUT-BOUND", "moderately input-bound": "MODERATELY INPUT-BOUND",
            "not input-bound": "NOT INPUT-BOUND", "idle": "IDLE"}


@dataclass
class Finding:
    kind: str  # epoch-start-stall, lost-workers, shm-risk, host-memory-risk, swap
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

    @property
    def healthy(self) -> bool:
        return self.verdict in ("not input-bound", "idle") and not self.findings


def verdict(stall: float | None, batches: float) -> str:
    if stall is None or batches <= 0:
        return "idle"
    if stall >= INPUT_BOUND:
        return "input-bound"
    if stall >= MODERATE:
        return "moderately input-bound"
    return "not input-bound"


def _int(text: str | None, default: int = 0) -> int:
    try:
        return int(text) if text not in (None, "") else default
    except ValueError:
        return default


def _flag(text: str | None) -> bool | None:
    return {"true": True, "false": False}.get((text or "").lower())


def shm_in_flight(batch_bytes: float, prefetch: int, workers: int, local_ranks: int = 1
                  ) -> float:
    """Shared memory the batches in flight may take: batch x prefetch x workers x ranks x 1.5.

    The one formula behind the loader's preflight warning and the doctor's findings.
    """
    return batch_bytes * prefetch * workers * local_ranks * SHM_SAFETY


def shm_size_advice(needed: float) -> str:
    """A --shm-size (whole GiB, at least 1g) with headroom for `needed` bytes."""
    return f"{max(1, math.ceil(needed * 1.25 / GiB))}g"


def diagnose(s: LoaderSignals, machine: Machine, local_ranks: int = 1) -> Diagnosis:
    """The diagnosis of one (loader, rank)."""
    stall = s.stall_share
    d = Diagnosis(s.loader, s.rank, verdict(stall, s.batches), {
        "stall_share": stall, "batches_per_second": s.batches_per_second,
        "samples_per_second": s.samples_per_second, "fetch_p50_seconds": s.fetch_p50,
        "fetch_p95_seconds": s.fetch_p95, "first_batch_seconds": s.first_batch_mean,
        "median_wait_seconds": s.median_wait, "worker_cpu_share": s.worker_cpu_share,
        "workers_configured": s.workers_configured, "workers_active": s.workers_active,
        "batch_bytes": s.batch_bytes, "gpu_utilization": s.gpu_utilization,
        "window_seconds": s.seconds})
    cfg = s.config
    workers = _int(cfg.get("num_workers"), int(s.workers_configured or 0))
    prefetch = _int(cfg.get("prefetch_factor"), 2) or 2
    persistent = _flag(cfg.get("persistent_workers"))
    pin = _flag(cfg.get("pin_memory"))
    starved = d.verdict in ("input-bound", "moderately input-bound")
    cuda = s.gpu_utilization is not None

    # --- findings -------------------------------------------------------------------
    if (s.first_batch_mean is not None and s.first_batch_mean >= FIRST_BATCH_MIN and
            s.first_batch_mean > FIRST_BATCH_FACTOR * (s.median_wait or 0.0)):
        ratio = s.first_batch_mean / s.median_wait if s.median_wait else math.inf
        d.findings.append(Finding("epoch-start-stall", (
            f"epoch-start stall: the first batch of an epoch takes {s.first_batch_mean:.2f} s "
            f"against a median wait of {_ms(s.median_wait)} (x{ratio:.0f})")))
    if s.workers_lost > 0 or (s.workers_active is not None and s.workers_configured
                              and s.batches > 0 and s.workers_active < s.workers_configured):
        d.findings.append(Finding("lost-workers", (
            f"lost workers: {s.workers_lost:.0f} died; {s.workers_active or 0:.0f} of "
            f"{s.workers_configured or 0:.0f} alive (out of memory? check dmesg for the OOM "
            "killer and /dev/shm)")))
    rec_workers = _recommend_workers(workers, starved, machine, local_ranks, cuda)
    in_flight = 0.0
    if s.batch_bytes:
        in_flight = shm_in_flight(s.batch_bytes, prefetch, max(workers, rec_workers), local_ranks)
    shm_total = s.shm_size if s.shm_size is not None else machine.shm_size
    if in_flight and shm_total is not None and in_flight > shm_total:
        d.findings.append(Finding("shm-risk", (
            f"/dev/shm risk: batches in flight need {_gib(in_flight)} "
            f"(batch {_gib(s.batch_bytes or 0)} x prefetch {prefetch} x "
            f"{max(workers, rec_workers)} workers x {local_ranks} ranks x {SHM_SAFETY}) but "
            f"/dev/shm holds {_gib(shm_total)}: expect bus errors")))
    available = s.memory_available if s.memory_available is not None else machine.memory_available
    if in_flight and available and in_flight > available:
        d.findings.append(Finding("host-memory-risk", (
            f"host memory risk: batches in flight need {_gib(in_flight)} but only "
            f"{_gib(available)} is available")))
    if s.swap_used and (s.swap_growth > 0 or (s.memory_total and s.memory_available and
                                              s.memory_available < 0.1 * s.memory_total)):
        d.findings.append(Finding("swap", (
            f"swap in use ({_gib(s.swap_used)}) and growing: workers are paging; use fewer "
            "workers or a smaller prefetch_factor")))

    # --- recommendations -------------------------------------------------------------
    rec = d.recommendations
    cores = _worker_cores(machine, local_ranks, cuda)
    if rec_workers != workers:
        spare = "" if cuda else ", keeping a core for the training loop, which runs on the CPU"
        n_cores = f"{cores} core{'' if cores == 1 else 's'}"
        why = (f"the loop waits for data {_pct(stall)} of the time and {n_cores} per "
               f"local rank can load in parallel (storage: {machine.storage}{spare})"
               if rec_workers > workers else
               f"more workers than the {n_cores} per local rank{spare} only fight for CPU")
        rec.append(Recommendation("num_workers", str(rec_workers), str(workers), why))
    eff_workers = max(workers, rec_workers)
    busy = s.worker_cpu_share
    want_prefetch = prefetch
    if any(f.kind in ("shm-risk", "host-memory-risk") for f in d.findings) and prefetch > 1:
        want_prefetch = max(1, prefetch // 2)
        why = "fewer batches in flight keep /dev/shm and host memory within bounds"
    elif starved and eff_workers and busy is not None and busy < 0.7 and workers:
        want_prefetch = max(4, prefetch)
        why = (f"workers use only {_pct(busy)} of a core each yet the loop waits: samples "
               "wait on I/O or cost unevenly, and a deeper queue hides that")
    else:
        why = "the default queue of two batches per worker is enough here"
    if eff_workers:
        rec.append(Recommendation("prefetch_factor", str(want_prefetch), str(prefetch), why))
    if eff_workers and persistent is not True:
        rec.append(Recommendation("persistent_workers", "True", str(persistent), (
            "workers are started again at every epoch otherwise, which stalls its first batch")))
    if cuda and pin is not True:
        rec.append(Recommendation("pin_memory", "True", str(pin), (
            "copies from pinned memory are faster and can overlap compute")))
    if cuda:
        rec.append(Recommendation("non_blocking", "True", "", (
            "with pinned memory, to_device(..., non_blocking=True) lets the copy overlap the "
            "previous step")))
    needed = shm_in_flight(s.batch_bytes or 0, want_prefetch, eff_workers, local_ranks)
    if eff_workers and needed and (shm_total is None or needed > shm_total):
        rec.append(Recommendation("--shm-size", shm_size_advice(needed),
                                  _gib(shm_total) if shm_total else "unknown", (
            f"workers hand batches over through /dev/shm and about {_gib(needed)} are in "
            "flight; Kubernetes: a memory-backed emptyDir at /dev/shm")))
    return d


def _worker_cores(machine: Machine, local_ranks: int, cuda: bool) -> int:
    """Cores a rank's workers can use; without a GPU the loop itself needs one of them."""
    cores = max(1, machine.usable_cores // max(1, local_ranks))
    return cores if cuda else max(1, cores - 1)


def _recommend_workers(workers: int, starved: bool, machine: Machine, local_ranks: int,
                       cuda: bool) -> int:
    cores = _worker_cores(machine, local_ranks, cuda)
    if machine.storage == "network":
        cap = STORAGE_WORKERS["network"]  # I/O-bound workers mostly wait: cores matter less
    else:
        cap = min(cores, STORAGE_WORKERS.get(machine.storage, cores))
    if workers > cap and machine.storage != "network":
        return cap
    if starved and workers < cap:
        return cap
    return workers


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.1f} ms"


def _gib(x: float) -> str:
    return f"{x / GiB:.2f} GiB" if x >= GiB / 10 else f"{x / 1024**2:.1f} MiB"


@dataclass
class Report:
    source: str
    machine: Machine
    diagnoses: list[Diagnosis]

    @property
    def healthy(self) -> bool:
        return all(d.healthy for d in self.diagnoses)

    def as_dict(self) -> dict[str, object]:
        return {"source": self.source, "healthy": self.healthy,
                "machine": self.machine.as_dict(),
                "loaders": [asdict(d) | {"healthy": d.healthy} for d in self.diagnoses]}

    def text(self) -> str:
        m = self.machine
        quota = "none" if m.cpu_quota is None else f"{m.cpu_quota:g} cores"
        lines = [f"dataloader doctor: {self.source}",
                 f"machine: {m.physical_cores} physical cores (cgroup CPU quota: {quota}), "
                 f"{_gib(m.memory_total)} memory ({_gib(m.memory_available)} available), "
                 f"/dev/shm {_gib(m.shm_size) if m.shm_size else 'unknown'}, "
                 f"storage under {m.data_path}: {m.storage}", ""]
        for d in self.diagnoses:
            f = d.figures
            lines.append(
                f"loader {d.loader}, rank {d.rank}: {VERDICTS[d.verdict]} - the loop waited "
                f"{_pct(f['stall_share'])} of the time for data; "
                f"{f['batches_per_second'] or 0:.1f} batches/s, "
                f"{f['samples_per_second'] or 0:.0f} samples/s, fetch p95 "
                f"{_ms(f['fetch_p95_seconds'])}")
            lines += [f"  ! {x.message}" for x in d.findings]
            if d.recommendations:
                lines.append("  settings:")
                for r in d.recommendations:
                    now = f" (now {r.current})" if r.current else ""
                    lines.append(f"    {r.setting}={r.value}{now}: {r.why}")
            lines.append("")
        lines.append("healthy" if self.healthy else "problems found")
        return "\n".join(lines) + "\n"
