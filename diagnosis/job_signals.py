"""A loader's job across its ranks: the job-level input stall and the input stragglers.

In synchronous data parallel (DDP, FSDP, torchrun) every step waits for the slowest rank
at its collective, so the ranks share one batch period and each one's lost time is the
slowest input's, not its own. The job's input stall share is therefore the largest
per-rank fetch wait per batch over the batch period (fetch wait plus step per batch, the
slowest rank's), exactly what the recording rule job_loader:dataloader_input_stall:ratio
computes (dashboards.recording). A single process gives its own share.

A rank is an input straggler when its fetch wait per batch exceeds the median rank's by
bands.STRAGGLER of the batch period or more: that much of every other rank's time is spent
waiting for its input. The median interpolates as Prometheus's quantile(0.5) does, so
the alert DataLoaderInputStraggler and the doctor agree. A fast rank's wait for the
straggler happens inside its step (in the all-reduce), where no timer of ours can tell
it from compute: it is estimated as the rank's step per batch minus the fastest rank's.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from dataloader_exporter.core import bands
from dataloader_exporter.diagnosis.signals import LoaderSignals


def points(share: float) -> int:
    """A 0-1 share in whole percent, as printed: verdicts and bands judge this figure."""
    return round(share * 100)


@dataclass
class RankTimes:
    """One rank's seconds per batch over the window."""

    rank: str
    batches: float
    fetch: float  # fetch wait per batch
    step: float  # step per batch (compute, and any wait for other ranks)

    @property
    def period(self) -> float:
        return self.fetch + self.step


@dataclass
class Straggler:
    rank: str
    fetch_per_batch: float
    excess_share: float  # its fetch wait above the median rank's, over the batch period


@dataclass
class Job:
    """One loader across the ranks of a job."""

    loader: str
    ranks: list[str]
    input_stall_share: float | None
    batch_period: float | None  # seconds, the slowest rank's fetch wait plus step per batch
    worst_fetch_per_batch: float | None
    median_fetch_per_batch: float | None
    fastest_step_per_batch: float | None
    stragglers: list[Straggler] = field(default_factory=list)
    waiting: dict[str, float] = field(default_factory=dict)  # rank -> s/batch, estimated

    @property
    def straggler_ranks(self) -> list[str]:
        return [s.rank for s in self.stragglers]

    def as_dict(self) -> dict[str, object]:
        return {"loader": self.loader, "ranks": len(self.ranks), "rank_list": self.ranks,
                "input_stall_share": self.input_stall_share,
                "batch_period_seconds": self.batch_period,
                "worst_fetch_per_batch_seconds": self.worst_fetch_per_batch,
                "median_fetch_per_batch_seconds": self.median_fetch_per_batch,
                "fastest_step_per_batch_seconds": self.fastest_step_per_batch,
                "stragglers": self.straggler_ranks,
                "straggler_figures": [vars(s) for s in self.stragglers],
                "waiting_for_other_ranks_seconds_per_batch": self.waiting}


def rank_times(s: LoaderSignals) -> RankTimes | None:
    """Per-batch times of a rank that handed out batches in the window; None otherwise
    (0/0 is unknown, not 0)."""
    if s.batches <= 0:
        return None
    return RankTimes(s.rank, s.batches, s.fetch_seconds / s.batches, s.step_seconds / s.batches)


def job(loader: str, signals: list[LoaderSignals]) -> Job:
    """The job-level view of one loader from all its ranks' signals."""
    times = [t for t in map(rank_times, signals) if t is not None]
    ranks = sorted({s.rank for s in signals}, key=_rank_key)
    if not times:
        return Job(loader, ranks, None, None, None, None, None)
    period = max(t.period for t in times)
    worst = max(t.fetch for t in times)
    median = statistics.median(t.fetch for t in times)
    fastest = min(t.step for t in times)
    j = Job(loader, ranks, worst / period if period > 0 else None, period, worst, median,
            fastest)
    if len(times) >= 2 and period > 0:
        for t in sorted(times, key=lambda t: _rank_key(t.rank)):
            excess = (t.fetch - median) / period
            if excess >= bands.STRAGGLER:  # as the rule and the alert compare it
                j.stragglers.append(Straggler(t.rank, t.fetch, excess))
        j.waiting = {t.rank: t.step - fastest for t in times}
    return j


def _rank_key(rank: str) -> tuple[int, str]:
    return (int(rank), "") if rank.isdigit() else (1 << 62, rank)


def jobs(signals: list[LoaderSignals]) -> list[Job]:
    """One Job per loader, in loader order."""
    by_loader: dict[str, list[LoaderSignals]] = {}
    for s in signals:
        by_loader.setdefault(s.loader, []).append(s)
    return [job(name, sigs) for name, sigs in sorted(by_loader.items())]
