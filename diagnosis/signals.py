"""From scrapes to the signals a person reads: per (loader, rank) stall share, waits, rates.

Shared by `doctor` and `top`. A window is two readings of the same series: counters and
histograms are read as their increase over the window (resets count from zero, as
Prometheus's increase() does), gauges as their latest value. Windows come from two
scrapes of /metrics or reads of a snapshot directory, or from Prometheus's increase()
over a time range. A run that has ended is read whole from one reading (Window.whole_run):
its totals over its loop time, since an ended run has no window worth reading.
"""

from __future__ import annotations

import math
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.diagnosis.tuner_report import TunerSignals, read_tuner
from dataloader_exporter.diagnosis.workersignals import (
    DatasetContainer,
    WorkerSignals,
    read_containers,
    read_failures,
    read_workers,
)

Labels = tuple[tuple[str, str], ...]
Series = dict[tuple[str, Labels], float]
_TIME_SUM, _STEP_SUM, _FETCH = cat.TIME.name + "_sum", cat.STEP.name + "_sum", cat.PHASE_FETCH


@dataclass(frozen=True)
class Scrape:
    """One parsed exposition and when it was taken."""

    at: float
    series: Series

    @classmethod
    def parse(cls, text: str, at: float | None = None) -> Scrape:
        series: Series = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                series[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return cls(time.time() if at is None else at, series)

    @classmethod
    def fetch(cls, url: str, timeout: float = 10.0) -> Scrape:
        """GET a /metrics URL; raises OSError or ValueError when it cannot be read."""
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return cls.parse(r.read().decode("utf-8"))


@dataclass(frozen=True)
class Window:
    """Increases of counters and histograms over `seconds`, and gauges at its end."""

    seconds: float
    increase: Series
    latest: Series
    change: Series = field(default_factory=dict)  # gauges: latest minus first value
    # rank -> ranks on its machine (one exporter instance); None: the ranks in the window
    local_ranks: dict[str, int] | None = None
    # (loader, rank) -> its seconds, where they are its own (a whole run); None: `seconds`
    loop_seconds: dict[tuple[str, str], float] | None = None

    @classmethod
    def between(cls, first: Scrape, second: Scrape) -> Window:
        inc: Series = {}
        change: Series = {}
        for key, v in second.series.items():
            before = first.series.get(key, 0.0)
            inc[key] = v - before if v >= before else v  # a reset: count from zero
            change[key] = v - before
        return cls(max(second.at - first.at, 1e-9), inc, dict(second.series), change)

    @classmethod
    def whole_run(cls, scrape: Scrape) -> Window:
        """The run so far from one reading: counters and histograms as their totals (an
        increase from zero), gauges as latest values, and each (loader, rank)'s seconds
        its loop time, fetch wait plus step. Snapshot files carry no start time, and the
        loop time makes every rate one per second of training loop, which is honest."""
        loop: dict[tuple[str, str], float] = {}
        for (name, labels), v in scrape.series.items():
            d = dict(labels)
            if "loader" in d and "rank" in d and (
                    name == _STEP_SUM or (name == _TIME_SUM and d.get("phase") == _FETCH)):
                key = (d["loader"], d["rank"])
                loop[key] = loop.get(key, 0.0) + v
        return cls(max(loop.values(), default=0.0), dict(scrape.series), dict(scrape.series),
                   loop_seconds=loop)

    @property
    def is_whole_run(self) -> bool:
        return self.loop_seconds is not None

    def seconds_of(self, loader: str, rank: str) -> float:
        """The seconds a (loader, rank)'s rates are over."""
        if self.loop_seconds is None:
            return self.seconds
        return self.loop_seconds.get((loader, rank), 0.0)


def window_of(first: Scrape, second: Scrape, ended: bool) -> Window:
    """The window between two readings; or, when the run is known to have ended (its
    files no longer written) and no loader handed out a batch between them but some had
    before, the whole run from the second (its totals say more than "idle"). A live run
    with no batch is idle or stalled, never "ended"."""
    window = Window.between(first, second)
    if ended and not _handed_out(window.increase) and _handed_out(second.series):
        return Window.whole_run(second)
    return window


def _handed_out(series: Series) -> bool:
    return any(v > 0 for (name, _), v in series.items() if name == cat.BATCHES.name)


def _get(series: Series, name: str, **labels: str) -> float | None:
    return series.get((name, tuple(sorted(labels.items()))))


def quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """histogram_quantile over (le, cumulative count) pairs, interpolating linearly; None
    without observations or without a finite bucket (the large-job setting's +Inf alone)."""
    pts = sorted(buckets)
    if len(pts) < 2 or pts[-1][1] <= 0:
        return None
    rank = q * pts[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in pts:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            width = count - prev_count
            frac = (rank - prev_count) / width if width else 1.0
            return prev_le + (le - prev_le) * frac
        prev_le, prev_count = le, count
    return prev_le


@dataclass
class LoaderSignals:
    """What one (loader, rank) did in a window, plus the machine-wide gauges beside it."""

    loader: str
    rank: str
    seconds: float = 0.0
    fetch_seconds: float = 0.0
    step_seconds: float = 0.0
    loop_cpu_seconds: float | None = None  # the loop thread's, without workers; None: unknown
    transfer_seconds: float = 0.0
    transfer_bytes: float = 0.0
    batches: float = 0.0
    samples: float | None = None  # None: not exported, its count cannot be known
    epochs: float = 0.0
    fetch_p50: float | None = None
    fetch_p95: float | None = None
    first_batch_mean: float | None = None
    median_wait: float | None = None
    workers_configured: float | None = None
    workers_active: float | None = None
    workers_lost: float = 0.0
    worker_cpu_seconds: float | None = None  # None: no per-worker figures (unknown)
    batch_bytes: float | None = None
    config: dict[str, str] = field(default_factory=dict)
    shm_size: float | None = None
    shm_used: float | None = None
    shm_free: float | None = None
    memory_total: float | None = None
    memory_available: float | None = None
    swap_used: float | None = None
    swap_growth: float = 0.0
    gpu_utilization: float | None = None
    cgroup_limit: float | None = None  # the exporter's container's memory limit and usage
    cgroup_usage: float | None = None
    workers: WorkerSignals = field(default_factory=WorkerSignals)
    # the dataset's largest container of Python objects (more than one only where its
    # series changed within a Prometheus range), the largest first; none found: empty
    dataset_containers: tuple[DatasetContainer, ...] = ()
    failures: dict[str, float] | None = None  # cause -> total; None: causes not exported
    tuner: TunerSignals | None = None  # None: the loader is not tuned (diagnosis.tuner_report)
    # The run has ended (its files are no longer written: read whole), and when its
    # rank's process exited normally (None: its last snapshot has no exit, or it is live).
    ended: bool = False
    exited_at: float | None = None

    @property
    def stall_share(self) -> float | None:
        total = self.fetch_seconds + self.step_seconds
        return self.fetch_seconds / total if total > 0 else None

    @property
    def batches_per_second(self) -> float:
        return self.batches / self.seconds if self.seconds else 0.0

    @property
    def samples_per_second(self) -> float | None:
        """None when the sample count is unknown (never 0 for unknown)."""
        if self.samples is None:
            return None
        return self.samples / self.seconds if self.seconds else 0.0

    @property
    def worker_cpu_share(self) -> float | None:
        """CPU the workers used, as a share of one core each over the window."""
        n = self.workers_configured
        if not n or not self.seconds or self.worker_cpu_seconds is None:
            return None
        return self.worker_cpu_seconds / (n * self.seconds)

    @property
    def shm_fill(self) -> float | None:
        if self.shm_size and self.shm_used is not None:
            return self.shm_used / self.shm_size
        return None


def _buckets(series: Series, name: str, want: dict[str, str]) -> list[tuple[float, float]]:
    out = []
    for (n, labels), v in series.items():
        if n != name:
            continue
        d = dict(labels)
        le = d.pop("le", None)
        if le is not None and all(d.get(k) == val for k, val in want.items()):
            out.append((float(le), v))
    return out


def loaders(window: Window) -> list[LoaderSignals]:
    """One LoaderSignals per (loader, rank) found in the window, sorted."""
    keys = set()
    for name, labels in [*window.latest, *window.increase]:
        d = dict(labels)
        if name == cat.BATCHES.name and "loader" in d and "rank" in d:
            keys.add((d["loader"], d["rank"]))
    return [_signals(window, loader, rank) for loader, rank in sorted(keys)]


def _sum_matching(series: Series, name: str, want: dict[str, str]) -> float | None:
    """The sum of the matching series; None when there is none (unknown, not 0)."""
    values = [v for (n, labels), v in series.items()
              if n == name and all(dict(labels).get(k) == val for k, val in want.items())]
    return sum(values) if values else None


def _signals(w: Window, loader: str, rank: str) -> LoaderSignals:
    lr = {"loader": loader, "rank": rank}
    inc, last = w.increase, w.latest
    fetch = {**lr, "phase": cat.PHASE_FETCH}
    transfer = {**lr, "phase": cat.PHASE_TRANSFER}
    s = LoaderSignals(loader, rank, seconds=w.seconds_of(loader, rank))
    s.fetch_seconds = _get(inc, cat.TIME.name + "_sum", **fetch) or 0.0
    s.transfer_seconds = _get(inc, cat.TIME.name + "_sum", **transfer) or 0.0
    s.step_seconds = _get(inc, cat.STEP.name + "_sum", **lr) or 0.0
    s.loop_cpu_seconds = _get(inc, cat.LOOP_CPU.name, **lr)
    s.batches = _get(inc, cat.BATCHES.name, **lr) or 0.0
    s.samples = _get(inc, cat.SAMPLES.name, **lr)  # None: unknown, not 0
    s.epochs = _get(inc, cat.EPOCHS.name, **lr) or 0.0
    s.transfer_bytes = _get(inc, cat.TRANSFER_BYTES.name, **lr) or 0.0
    window_buckets = _buckets(inc, cat.TIME.name + "_bucket", fetch)
    s.fetch_p50 = quantile(0.5, window_buckets)
    s.fetch_p95 = quantile(0.95, window_buckets)
    # Epoch starts are rare: judge them over the whole run, not just the window.
    s.median_wait = quantile(0.5, _buckets(last, cat.TIME.name + "_bucket", fetch))
    first_n = _get(last, cat.FIRST_BATCH.name + "_count", **lr)
    if first_n:
        s.first_batch_mean = (_get(last, cat.FIRST_BATCH.name + "_sum", **lr) or 0.0) / first_n
    s.workers_configured = _get(last, cat.WORKERS_CONFIGURED.name, **lr)
    s.workers_active = _get(last, cat.WORKERS_ACTIVE.name, **lr)
    s.workers_lost = _get(last, cat.WORKERS_LOST.name, **lr) or 0.0
    s.worker_cpu_seconds = _sum_matching(inc, cat.WORKER_CPU.name, lr)
    s.batch_bytes = _get(last, cat.BATCH_BYTES.name, **lr)
    for (n, labels), _v in last.items():
        if n == cat.INFO.name and dict(labels).get("loader") == loader and (
                dict(labels).get("rank") == rank):
            s.config = {k: v for k, v in labels if k not in ("loader", "rank")}
    shm = [(dict(labels).get("path", ""), v) for (n, labels), v in last.items()
           if n == cat.SHM_SIZE.name]
    if shm:
        path = "/dev/shm" if any(p == "/dev/shm" for p, _ in shm) else shm[0][0]
        s.shm_size = _get(last, cat.SHM_SIZE.name, path=path)
        s.shm_used = _get(last, cat.SHM_USED.name, path=path)
        s.shm_free = _get(last, cat.SHM_FREE.name, path=path)
    s.memory_total = _get(last, cat.HOST_MEMORY_TOTAL.name)
    s.memory_available = _get(last, cat.HOST_MEMORY_AVAILABLE.name)
    s.swap_used = _get(last, cat.HOST_SWAP_USED.name)
    s.swap_growth = _get(w.change, cat.HOST_SWAP_USED.name) or 0.0
    utils = [v for (n, _), v in last.items() if n == cat.GPU_UTILIZATION.name]
    s.gpu_utilization = sum(utils) / len(utils) if utils else None
    s.cgroup_limit = _get(last, cat.CGROUP_MEMORY_LIMIT.name)
    s.cgroup_usage = _get(last, cat.CGROUP_MEMORY_USAGE.name)
    s.workers = read_workers(w.increase, w.latest, w.change, lr)
    s.dataset_containers = read_containers(last, lr)
    s.failures = read_failures(last, lr)
    s.tuner = read_tuner(last, lr)
    s.ended = w.is_whole_run
    # The process's, by rank (an older sidecar serving an older trainer's: by loader too).
    s.exited_at = _get(last, cat.EXITED.name, rank=rank) or _get(last, cat.EXITED.name, **lr)
    return s
