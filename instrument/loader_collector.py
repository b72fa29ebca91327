"""The prometheus_client Collector over a process's loader recorders: the trainer metrics
of the catalogue, built fresh at each collection (a snapshot write or a scrape), after the
recorders have binned their raw durations (LoaderRecorder.flush). Off the hot path.

Nothing that was not measured is exported: a histogram appears with its first observation
(no transfer histogram for a loader that never called to_device), and the transfer byte
counter with the first transfer. $DATALOADER_EXPORTER_SERIES=job (core/seriesmode.py)
narrows each (loader, rank) to the job-level series, its histograms to their +Inf bucket;
the recorders keep every bucket either way (the loader tuner reads them).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.metrics_core import Metric as Family
from prometheus_client.registry import Collector

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.core import seriesmode
from dataloader_exporter.exporter.collectors.base import family

from .hotpath.recorder import LoaderRecorder

TRAINER_METRICS: tuple[cat.Metric, ...] = tuple(m for m in cat.ALL if m.source == cat.TRAINER)
_STEP_LES = frozenset((*(repr(float(b)) for b in cat.STEP.buckets), "+Inf"))
log = logging.getLogger("dataloader_exporter.instrument")


class LoaderCollector(Collector):
    """Yields the trainer metrics of every recorder in a process's registry, all of them
    or the job-level ones (series: seriesmode.FULL or JOB; None: $DATALOADER_EXPORTER_SERIES,
    a bad value logged, naming the variable and its values, and taken as FULL)."""

    def __init__(self, recorders: Callable[[], Iterable[LoaderRecorder]],
                 series: str | None = None) -> None:
        self._recorders = recorders
        if series is None:
            series, complaint = seriesmode.series_mode(os.environ)
            if complaint:
                log.warning("dataloader-exporter: %s", complaint)
        if series not in seriesmode.SERIES_MODES:
            raise ValueError(f"series: expected one of {seriesmode.SERIES_MODES}, not {series!r}")
        self.series = series

    def describe(self) -> Iterator[Family]:
        """The families collect() yields, so a registry refuses a second trainer collector."""
        for metric in TRAINER_METRICS:
            yield family(metric)

    def collect(self) -> Iterator[Family]:
        recs = list(self._recorders())
        for r in recs:
            r.flush()
        yield from _families(recs, job=self.series == seriesmode.JOB)


def _families(recs: list[LoaderRecorder], job: bool = False) -> Iterator[Family]:
    """The trainer families. job: the job-level ones only (the histograms as their +Inf
    bucket, fetch phase only); the others are yielded empty, never computed, since every
    family is described and readers expect them all."""
    time_f, step_f, first_f = family(cat.TIME), family(cat.STEP), family(cat.FIRST_BATCH)
    phases = seriesmode.JOB_PHASES if job else (cat.PHASE_FETCH, cat.PHASE_TRANSFER)
    for r in recs:
        with r.lock:  # a concurrent flush must not tear a histogram
            for phase, h in ((cat.PHASE_FETCH, r.fetch_h), (cat.PHASE_TRANSFER, r.transfer_h)):
                if phase in phases:
                    _histogram(time_f, [r.name, r.rank, phase], h.buckets(), h.sum, job)
            _histogram(step_f, [r.name, r.rank], _exported(r.step_h.buckets(), _STEP_LES),
                       r.step_h.sum, job)
            _histogram(first_f, [r.name, r.rank], r.first_h.buckets(), r.first_h.sum, job)
    yield time_f
    yield step_f
    yield first_f
    simple: list[tuple[cat.Metric, Callable[[LoaderRecorder], float | None]]] = [
        (cat.BATCHES, lambda r: r.batches),
        (cat.SAMPLES, lambda r: r.samples if r.samples_known else None),
        (cat.EPOCHS, lambda r: r.epochs),
        (cat.TRANSFER_BYTES, lambda r: r.transfer_bytes if _transferred(r) else None),
        (cat.LAST_BATCH, LoaderRecorder.last_batch_unix),
        (cat.BATCH_BYTES, lambda r: r.batch_bytes if r.batch_bytes >= 0 else None),
        (cat.LOOP_CPU, lambda r: None if r.workers.loop.cpu_ns is None
         else r.workers.loop.cpu_ns / 1e9),
        (cat.WORKERS_CONFIGURED, lambda r: _int(r.config.get("num_workers"))),
        (cat.WORKERS_ACTIVE, lambda r: r.workers.active),
        (cat.WORKERS_LOST, lambda r: r.workers.lost),
    ]
    for metric, get in simple:
        f = family(metric)
        for r in recs if not job or metric.name in seriesmode.JOB_METRICS else ():
            value = get(r)
            if value is not None:
                f.add_metric([r.name, r.rank], value)
        yield f
    yield _exits(recs)
    cpu, samples = family(cat.WORKER_CPU), family(cat.WORKER_SAMPLES)
    for r in () if job else recs:
        for worker, cpu_ns, n, _ in r.workers.per_worker():  # a worker's last batch: unread
            labels = [r.name, r.rank, str(worker)]
            cpu.add_metric(labels, cpu_ns / 1e9)
            if n is not None:
                samples.add_metric(labels, n)
    yield cpu
    yield samples
    yield from _proc_families(recs, job)
    changes, stable = family(cat.TUNER_CHANGES), family(cat.TUNER_STABLE)
    for r in () if job else recs:
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


def _exits(recs: list[LoaderRecorder]) -> Family:
    """The exit time: the process's, not a loader's, so one series per rank among the
    recorders whose exit was recorded (kept in either setting)."""
    at: dict[str, float] = {}
    for r in recs:
        if r.exited_at is not None:
            at[r.rank] = max(r.exited_at, at.get(r.rank, r.exited_at))
    f = family(cat.EXITED)
    for rank, when in sorted(at.items()):
        f.add_metric([rank], when)
    return f


def activity(recs: Iterable[LoaderRecorder]) -> tuple[object, ...]:
    """Equal across two calls when none of the recorders recorded anything in between: a
    batch, an epoch, a timing, a transfer, a batch's bytes, a GPU, a configuration, a
    tuner's change, a worker generation started, stopped or collected, a worker's batch,
    a lost worker or a failure (WorkerTracker.version), an exit. Not what changes without
    a record: live workers' liveness and memory, and the time since the last batch."""
    return tuple((r, r.batches, r.samples, r.samples_known, r.iters, r.epochs,
                  r.transfer_bytes, r.batch_bytes, *_observations(r), r.gpu_uuid, r.exited_at,
                  r.tuner_stable, r.tuner_settings, tuple(r.tuner_changes.items()),
                  tuple(r.config.items()), r.workers.version()) for r in recs)


def _observations(r: LoaderRecorder) -> tuple[int, ...]:
    """Durations recorded per histogram, binned or not: a flush leaves them as they are."""
    with r.lock:
        return (int(r.fetch_h.counts.sum()) + len(r.fetch),
                int(r.step_h.counts.sum()) + len(r.step),
                int(r.first_h.counts.sum()) + len(r.first),
                int(r.transfer_h.counts.sum()) + len(r.transfer) + len(r.pending_events))


def _proc_families(recs: list[LoaderRecorder], job: bool) -> Iterator[Family]:
    """Where the workers' time and memory go (/proc, procstat.py; none with job), the
    dataset's containers of Python objects (cowscan.py; kept with job), and failures by
    cause."""
    time_f, read_f, faults_f = (family(m) for m in (cat.WORKER_TIME, cat.WORKER_READ,
                                                     cat.WORKER_MAJOR_FAULTS))
    memory_f, max_f, fail_f = (family(m) for m in (cat.WORKER_MEMORY, cat.WORKER_MAX_RSS,
                                                    cat.FAILURES))
    growth_f, objects_f = family(cat.WORKER_PRIVATE_GROWTH), family(cat.DATASET_OBJECTS)
    for r in recs:
        lr = [r.name, r.rank]
        for cause, n in r.workers.failures.items():
            if n:  # a cause seen; the alerts take a series first seen at 1 as a failure
                fail_f.add_metric([*lr, cause], n)
        for c in r.dataset_objects[:1]:  # the largest
            objects_f.add_metric([*lr, c.attribute, c.container, c.item, str(c.objects)],
                                 c.bytes)
        fig = None if job else r.workers.proc_figures()
        if fig is None:
            continue  # no worker read (yet): unknown, not 0
        split: list[tuple[Any, tuple[str, ...], tuple[int | None, ...], float]] = [
            (time_f, cat.WORKER_STATES, (fig.running_ns, fig.waiting_ns, fig.blocked_ns), 1e9),
            (read_f, cat.READ_SOURCES, (fig.read_storage, fig.read_syscalls), 1.0),
            (memory_f, cat.MEMORY_KINDS, (  # RSS only where PSS cannot be read
                None if fig.pss_readable else fig.rss_bytes, fig.pss_bytes,
                fig.swap_bytes, fig.available_bytes), 1.0)]
        for fam, names, values, scale in split:
            for label, v in zip(names, values, strict=True):
                if v is not None:
                    fam.add_metric([*lr, label], v / scale)
        if fig.major_faults is not None:
            faults_f.add_metric(lr, fig.major_faults)
        if fig.max_rss_bytes is not None:
            max_f.add_metric(lr, fig.max_rss_bytes)
        if fig.private_growth is not None:
            growth_f.add_metric(lr, fig.private_growth)
    yield from (time_f, read_f, faults_f, memory_f, max_f, growth_f, objects_f, fail_f)


def _histogram(f: Any, labels: list[str], buckets: list[tuple[str, float]], total: float,
               job: bool) -> None:
    """One histogram child, unless it holds no observation (nothing measured: left out);
    job: its +Inf bucket alone."""
    if buckets[-1][1] <= 0:
        return
    f.add_metric(labels, buckets[-1:] if job else buckets, total)


def _exported(buckets: list[tuple[str, float]], les: frozenset[str]) -> list[tuple[str, float]]:
    """The cumulative buckets at the catalogue's bounds (and +Inf): a recorder may bin
    finer than what is exported (steps: cat.STEP_BINS), and a subset stays exact."""
    return [b for b in buckets if b[0] in les]


def _transferred(r: LoaderRecorder) -> bool:
    """Whether to_device moved or timed a batch of the loader (its byte count is known)."""
    return r.transfer_bytes > 0 or r.transfer_h.counts.sum() > 0 or bool(r.pending_events)


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
