"""What the per-batch code records for one (loader, rank), and how it is read.

The training loop only appends integer nanoseconds to bounded rings and bumps integers
(base.py, in C where built). Whoever reads the metrics (the snapshot thread, a
scrape) takes the rings' contents under a lock and bins them into cumulative histograms
with numpy (LoaderRecorder.flush), so no lock, file or GPU synchronisation sits on the
per-batch path. The metric families built from recorders: instrument/loader_collector.py.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from dataloader_exporter.core import catalogue as cat

from ..worker_tracker import WorkerTracker
from .base import Counts, Ring, drain

if TYPE_CHECKING:
    from ..cowscan import Container

# Durations kept per queue between two reads (snapshot writes or scrapes, normally every
# second): 131072 batches of a few microseconds each, about 1 MB per queue at most.
MAX_UNREAD = 1 << 17


class DurationHistogram:
    """Cumulative histogram in the catalogue's buckets, fed in bulk."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.bounds = buckets
        self._les = [_le(b) for b in buckets]  # the bounds as the text format writes them
        self._bounds_ns = np.array([b * 1e9 for b in buckets], dtype=np.float64)
        self.counts = np.zeros(len(buckets) + 1, dtype=np.int64)
        self.sum = 0.0

    def add_ns(self, values: list[int] | np.ndarray) -> None:
        if not len(values):
            return
        arr = np.asarray(values, dtype=np.int64)
        # side="left": a value equal to a bound belongs in that bound's bucket (le).
        idx = np.searchsorted(self._bounds_ns, arr, side="left")
        self.counts += np.bincount(idx, minlength=len(self.counts))
        self.sum += float(arr.sum()) / 1e9

    def buckets(self) -> list[tuple[str, float]]:
        cum = np.cumsum(self.counts, dtype=np.float64).tolist()
        out = list(zip(self._les, cum, strict=False))  # cum has one more: +Inf's
        out.append(("+Inf", cum[-1]))
        return out


def _le(bound: float) -> str:
    return repr(float(bound))


class LoaderRecorder(Counts):
    """Everything measured for one (loader, rank); shared by loaders of one name. The
    counters the loop bumps and its rings are Counts' (base.py): batches, samples,
    last_batch_ns (perf_counter_ns of the last batch handed out), fetch and step."""

    def __init__(self, name: str, rank: str) -> None:
        self.name = name
        self.rank = rank
        # Hot path (the loop appends; readers take all under self.lock). Bounded, so a
        # registry nobody reads keeps only the newest observations instead of growing.
        self.fetch = Ring(MAX_UNREAD)
        self.step = Ring(MAX_UNREAD)
        self.first = Ring(MAX_UNREAD)  # the first batches' waits since iter()
        self.transfer = Ring(MAX_UNREAD)
        self.epochs = 0  # epochs begun (first batches)
        self.first_at_ns = 0  # perf_counter_ns of the latest epoch's first batch (0: none)
        # False once a batch's samples could not be counted (batch.py,
        # workerblock.py): the total is then unknown and not exported, for the
        # rest of the process.
        self.samples_known = True
        self.iters = 0  # iter()s of the loaders of this name (the tuner's check)
        self.batch_bytes = -1
        self.transfer_bytes = 0
        # CUDA transfers: (start_event, end_event) pairs read once complete.
        self.pending_events: deque[tuple[Any, Any]] = deque()
        self.config: dict[str, str] = {}
        # The last iter()'s settings (Instruments.start_epoch): (inputs, LoaderConfig,
        # /dev/shm size, the labels above), kept for the next loader of the name.
        self.made: tuple[tuple[Any, ...], Any, str, dict[str, str]] | None = None
        self.gpu_uuid = ""  # the GPU batches go to (dataloader_info), "" until known
        # The dataset's large containers of Python objects, as its loader's first pool
        # found them (cowscan.py): each worker copies them as it reads them.
        self.dataset_objects: tuple[Container, ...] = ()
        self.scanned: weakref.ref[Any] | None = None  # the dataset they were looked for in
        self.exited_at: float | None = None  # Unix time of a normal exit (Hub.exiting)
        self.workers = WorkerTracker()
        # The loader tuner (tuner/loop.py): changes by (setting, reason); whether it is stable
        # (None: not tuned); its check after each flush.
        self.tuner_changes: dict[tuple[str, str], int] = {}
        self.tuner_stable: bool | None = None
        self.tuner_settings = ""  # the settings it tunes, comma-separated
        # A tuned loader without workers: the loop thread's CPU time in its fetches
        # (tuner/iterator.CpuTunedIterator), and how many fetches it covers.
        self.fetch_cpu_ns = 0
        self.fetch_cpu_n = 0
        self.on_flush: Callable[[], None] | None = None
        # Reader side.
        self.lock = threading.Lock()
        self.fetch_h = DurationHistogram(cat.PHASE_BUCKETS[cat.PHASE_FETCH])
        self.transfer_h = DurationHistogram(cat.PHASE_BUCKETS[cat.PHASE_TRANSFER])
        self.step_h = DurationHistogram(cat.STEP_BINS)  # finer than exported: paused() reads 3 s
        self.first_h = DurationHistogram(cat.FIRST_BATCH.buckets)

    def flush(self, now: float | None = None, force: bool = False) -> None:
        """Moves raw measurements into histograms and refreshes worker liveness (force:
        the workers read now, past their interval: the tuner's readings)."""
        with self.lock:
            self.fetch_h.add_ns(drain(self.fetch))
            self.step_h.add_ns(drain(self.step))
            self.first_h.add_ns(drain(self.first))
            self.transfer_h.add_ns(drain(self.transfer))
            self.transfer_h.add_ns(self._completed_events())
        if self.samples_known and self.workers.miscounted():
            self.samples_known = False
        self.workers.refresh(time.monotonic() if now is None else now, batches=self.batches,
                             force=force)
        if self.on_flush is not None:
            with contextlib.suppress(Exception):  # advice must never break a scrape
                self.on_flush()

    @property
    def loop_tid(self) -> int:
        """The native id of the thread that last called iter() on a loader of this name
        (0: none yet)."""
        return self.workers.loop.tid

    def miscount(self) -> None:
        """A batch's count was found wrong (a custom collate_fn, workerblock.py)."""
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
