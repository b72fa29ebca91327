"""Per-loader measurements: raw durations on the hot path, histograms off it.

The training loop only appends integer nanoseconds to a deque and bumps plain ints
(about 40 ns each). Whoever reads the metrics (the snapshot thread, an HTTP scrape)
drains the deques under a lock and bins them with numpy, so no lock, file or GPU
synchronisation ever sits on the per-batch path. A prometheus_client Histogram would
cost 0.7-1.6 us per observe on the hot path instead (../shared/FACTS.md).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
from prometheus_client.metrics_core import Metric as Family
from prometheus_client.registry import Collector

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.exporter.collectors.base import family

from .tracker import WorkerTracker

# Durations kept per queue between two reads (snapshot writes or scrapes, normally every
# second): 131072 batches of a few microseconds each, about 1 MB per queue at most.
MAX_UNREAD = 1 << 17


class Histo:
    """Cumulative histogram in the catalogue's buckets, fed in bulk."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.bounds = buckets
        self._bounds_ns = np.array([b * 1e9 for b in buckets], dtype=np.float64)
        self.counts = np.zeros(len(buckets) + 1, dtype=np.int64)
        self.sum = 0.0

    def add_ns(self, values: list[int]) -> None:
        if not values:
            return
        arr = np.asarray(values, dtype=np.int64)
        # side="left": a value equal to a bound belongs in that bound's bucket (le).
        idx = np.searchsorted(self._bounds_ns, arr, side="left")
        self.counts += np.bincount(idx, minlength=len(self.counts))
        self.sum += float(arr.sum()) / 1e9

    def buckets(self) -> list[tuple[str, float]]:
        cum = np.cumsum(self.counts)
        out = [(_le(b), float(c)) for b, c in zip(self.bounds, cum[:-1], strict=True)]
        out.append(("+Inf", float(cum[-1])))
        return out


def _le(bound: float) -> str:
    return repr(float(bound))


def _drain(q: deque[int]) -> list[int]:
    pop = q.popleft
    return [pop() for _ in range(len(q))]


class LoaderRecorder:
    """Everything measured for one (loader, rank); shared by loaders of one name."""

    def __init__(self, name: str, rank: str) -> None:
        self.name = name
        self.rank = rank
        # Hot path (main thread appends; readers popleft under self.lock). Bounded, so a
        # registry nobody reads keeps only the newest observations instead of growing.
        self.fetch: deque[int] = deque(maxlen=MAX_UNREAD)
        self.step: deque[int] = deque(maxlen=MAX_UNREAD)
        self.transfer: deque[int] = deque(maxlen=MAX_UNREAD)
        self.first: deque[int] = deque(maxlen=MAX_UNREAD)
        self.batches = 0
        self.samples = 0
        # False once a batch's samples could not be counted (batch.py, workers.py): the
        # total is then unknown and not exported, for the rest of the process.
        self.samples_known = True
        self.epochs = 0
        self.iters = 0  # iter()s of the loaders of this name (the tuner's check)
        self.batch_bytes = -1
        self.transfer_bytes = 0
        self.last_batch_ns = 0  # perf_counter_ns of the last batch handed out
        # CUDA transfers: (start_event, end_event) pairs read once complete.
        self.pending_events: deque[tuple[Any, Any]] = deque()
        self.config: dict[str, str] = {}
        self.gpu_uuid = ""  # the GPU batches go to (dataloader_info), "" until known
        self.exited_at: float | None = None  # Unix time of a normal exit (hub.py)
        self.workers = WorkerTracker()
        # The loader tuner (tuning.py): changes by (setting, reason); whether it is stable
        # (None: not tuned); its check after each flush.
        self.tuner_changes: dict[tuple[str, str], int] = {}
        self.tuner_stable: bool | None = None
        self.tuner_settings = ""  # the settings it tunes, comma-separated
        self.on_flush: Callable[[], None] | None = None
        # Reader side.
        self.lock = threading.Lock()
        self.fetch_h = Histo(cat.TIME.buckets)
        self.transfer_h = Histo(cat.TIME.buckets)
        self.step_h = Histo(cat.STEP.buckets)
        self.first_h = Histo(cat.FIRST_BATCH.buckets)

    def flush(self, now: float | None = None, force: bool = False) -> None:
        """Moves raw measurements into histograms and refreshes worker liveness (force:
        the workers read now, past their interval: the tuner's readings)."""
        with self.lock:
            self.fetch_h.add_ns(_drain(self.fetch))
            self.step_h.add_ns(_drain(self.step))
            self.first_h.add_ns(_drain(self.first))
            self.transfer_h.add_ns(_drain(self.transfer) + self._completed_events())
        if self.samples_known and self.workers.miscounted():
            self.samples_known = False
        self.workers.refresh(time.monotonic() if now is None else now, batches=self.batches,
                             force=force)
        if self.on_flush is not None:
            with contextlib.suppress(Exception):  # advice must never break a scrape
                self.on_flush()

    def miscount(self) -> None:
        """A batch's count was found wrong (a custom collate_fn, workers.py)."""
        self.samples_known = False

    def _completed_events(self) -> list[int]:
        done: list[int] = []
        q = self.pending_events
        while q:
            start, end = q[0]
            try:
                if not end.query():
                    break
                done.append(int(start.elapsed_time(end) * 1e6))
            except Exception:  # a failed CUDA context must not break metrics
                pass
            q.popleft()
        return done

    def last_batch_unix(self) -> float | None:
        if not self.last_batch_ns:
            return None
        return time.time() - (time.perf_counter_ns() - self.last_batch_ns) / 1e9


TRAINER_METRICS: tuple[cat.Metric, ...] = tuple(m for m in cat.ALL if m.source == cat.TRAINER)


class LoaderCollector(Collector):
    """Yields the trainer metrics of every recorder in a process's registry."""

    def __init__(self, recorders: Callable[[], Iterable[LoaderRecorder]]) -> None:
        self._recorders = recorders

    def describe(self) -> Iterator[Family]:
        """The families collect() yields, so a registry refuses a second trainer collector."""
        for metric in TRAINER_METRICS:
            yield family(metric)

    def collect(self) -> Iterator[Family]:
        recs = list(self._recorders())
        for r in recs:
            r.flush()
        yield from _families(recs)


def _families(recs: list[LoaderRecorder]) -> Iterator[Family]:
    time_f, step_f, first_f = family(cat.TIME), family(cat.STEP), family(cat.FIRST_BATCH)
    for r in recs:
        with r.lock:  # a concurrent flush must not tear a histogram
            for phase, h in ((cat.PHASE_FETCH, r.fetch_h), (cat.PHASE_TRANSFER, r.transfer_h)):
                time_f.add_metric([r.name, r.rank, phase], h.buckets(), h.sum)
            step_f.add_metric([r.name, r.rank], r.step_h.buckets(), r.step_h.sum)
            first_f.add_metric([r.name, r.rank], r.first_h.buckets(), r.first_h.sum)
    yield time_f
    yield step_f
    yield first_f
    simple: list[tuple[cat.Metric, Callable[[LoaderRecorder], float | None]]] = [
        (cat.BATCHES, lambda r: r.batches),
        (cat.SAMPLES, lambda r: r.samples if r.samples_known else None),
        (cat.EPOCHS, lambda r: r.epochs),
        (cat.TRANSFER_BYTES, lambda r: r.transfer_bytes),
        (cat.LAST_BATCH, LoaderRecorder.last_batch_unix),
        (cat.EXITED, lambda r: r.exited_at),
        (cat.BATCH_BYTES, lambda r: r.batch_bytes if r.batch_bytes >= 0 else None),
        (cat.WORKERS_CONFIGURED, lambda r: _int(r.config.get("num_workers"))),
        (cat.WORKERS_ACTIVE, lambda r: r.workers.active),
        (cat.WORKERS_LOST, lambda r: r.workers.lost),
    ]
    for metric, get in simple:
        f = family(metric)
        for r in recs:
            value = get(r)
            if value is not None:
                f.add_metric([r.name, r.rank], value)
        yield f
    cpu, samples, beat = family(cat.WORKER_CPU), family(cat.WORKER_SAMPLES), family(
        cat.WORKER_HEARTBEAT)
    for r in recs:
        for worker, cpu_ns, n, beat_ns in r.workers.per_worker():
            labels = [r.name, r.rank, str(worker)]
            cpu.add_metric(labels, cpu_ns / 1e9)
            if n is not None:
                samples.add_metric(labels, n)
            beat.add_metric(labels, beat_ns / 1e9)
    yield cpu
    yield samples
    yield beat
    yield from _proc_families(recs)
    changes, stable = family(cat.TUNER_CHANGES), family(cat.TUNER_STABLE)
    for r in recs:
        state = r.tuner_stable  # read once: the tuner may stop between two reads
        if state is not None:
            stable.add_metric([r.name, r.rank, r.tuner_settings], float(state))
        for (setting, reason), n in sorted(r.tuner_changes.items()):
            changes.add_metric([r.name, r.rank, setting, reason], n)
    yield changes
    yield stable
    info = family(cat.INFO)
    for r in recs:
        if r.config:
            known = {**r.config, "gpu_uuid": r.gpu_uuid}
            info.add_metric([r.name, r.rank, *(known.get(k, "") for k in cat.INFO_LABELS[2:])],
                            1)
    yield info


def _proc_families(recs: list[LoaderRecorder]) -> Iterator[Family]:
    """Where the workers' time and memory go (/proc, procstat.py), and failures by cause."""
    time_f, read_f, faults_f = (family(m) for m in (cat.WORKER_TIME, cat.WORKER_READ,
                                                     cat.WORKER_MAJOR_FAULTS))
    memory_f, max_f, fail_f = (family(m) for m in (cat.WORKER_MEMORY, cat.WORKER_MAX_RSS,
                                                    cat.FAILURES))
    for r in recs:
        lr = [r.name, r.rank]
        for cause, n in r.workers.failures.items():
            if n:  # a cause seen; the alerts take a series first seen at 1 as a failure
                fail_f.add_metric([*lr, cause], n)
        fig = r.workers.proc_figures()
        if fig is None:
            continue  # no worker read (yet): unknown, not 0
        split: list[tuple[Any, tuple[str, ...], tuple[int | None, ...], float]] = [
            (time_f, cat.WORKER_STATES, (fig.running_ns, fig.waiting_ns, fig.blocked_ns), 1e9),
            (read_f, cat.READ_SOURCES, (fig.read_storage, fig.read_syscalls), 1.0),
            (memory_f, cat.MEMORY_KINDS, (fig.rss_bytes, fig.pss_bytes, fig.swap_bytes,
                                          fig.available_bytes), 1.0)]
        for fam, names, values, scale in split:
            for label, v in zip(names, values, strict=True):
                if v is not None:
                    fam.add_metric([*lr, label], v / scale)
        if fig.major_faults is not None:
            faults_f.add_metric(lr, fig.major_faults)
        max_f.add_metric(lr, fig.max_rss_bytes)
    yield from (time_f, read_f, faults_f, memory_f, max_f, fail_f)


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
