"""What one epoch of a tuned loader measured, as the tuner judges it (core/tuner/types.Epoch).

A mark holds the loader's counters at an epoch's iter(); the epoch since a mark is read
from the same counters at the next iter() (or, in a long epoch, while it runs):

- samples (or batches) per second over the wall time from iter() to the last batch
  handed out, so a worker pool's start (and its rebuild) counts; the input stall from
  the first batch on (the wait for the first batch, a pool's start, is its own figure,
  kept where the epoch's iter() started a new pool: core/tuner/persist.py);
- the workers' running / waiting-for-a-CPU / blocked shares (procstat.py) over the epoch,
  a virtual machine's steal (core/facts/cores.py) counted as running: the exported
  figures count it as waiting, but it is a tax on each ns run, not a queue for the cores
  that fewer workers would shorten, and a worker holds its virtual CPU through it;
- the memory one worker takes (PSS, else its largest RSS; with no worker yet, the main
  process's RSS, which a forked worker can at most take), projected: with the part of
  the dataset's containers of Python objects a worker has not copied yet (copy-on-read,
  instrument/cowscan.py), counted before it is paid; and a batch's bytes;
- the fetch waits' burstiness (95th percentile over the median, from the histogram);
- per batch, for the model (core/tuner/model.py): the time a batch takes to make and its
  CPU share (with workers: their running and blocked time; without: the fetch's wall
  time and the loop thread's CPU time in it, CpuTunedIterator), the loop's time (the
  step) and the training process's CPU time outside the fetch.

An epoch of fewer than MIN_BATCHES batches, or one in which another loader of the same
name ran (their figures add up), is not judged.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from time import perf_counter_ns, process_time_ns
from typing import TYPE_CHECKING, Any

import numpy as np

from dataloader_exporter.core.facts.cores import machine_ticks, stolen_per_run
from dataloader_exporter.core.settings import log_name
from dataloader_exporter.core.tuner.model import Load
from dataloader_exporter.core.tuner.types import Epoch, Setting

from ..envsettings import once
from ..hotpath.recorder import LoaderRecorder
from ..procstat import Figures

if TYPE_CHECKING:
    from ..cowscan import Container

log = logging.getLogger("dataloader_exporter.instrument")

MIN_BATCHES = 8  # an epoch with fewer batches says too little to judge
BURST_FLOOR = 0.001  # seconds: a 95th-percentile wait below this is not a burst
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def setting_of(loader: Any) -> Setting:
    """The loader's num_workers and prefetch_factor now (torch's default 2 when unset)."""
    return Setting(int(loader.num_workers or 0), int(loader.prefetch_factor or 2))


@dataclass(frozen=True)
class Mark:
    """A loader's counters at an epoch's iter()."""

    setting: Setting
    t_ns: int
    batches: int
    samples: int
    step_s: float
    fetch_counts: np.ndarray
    proc: tuple[int | None, int | None, int | None]
    iters: int  # iter()s of every loader of this name so far
    cpu_ns: int = 0  # the training process's CPU time (all its threads)
    loop_sched: tuple[int, int] | None = None  # the loop thread's running, run-queue ns
    ticks: tuple[int, int] | None = None  # the machine's busy and stolen CPU ticks (no workers)
    step_counts: np.ndarray | None = None  # the step histogram's bucket counts
    own_iters: int = 1  # this loader's own iter()s to come in its window (0: mid-epoch)
    fetch_cpu: tuple[int, int] = (0, 0)  # rec.fetch_cpu_ns, rec.fetch_cpu_n
    fresh_pool: bool = False  # its iter() starts a new pool of workers
    persists: bool = False  # that pool is persistent


def take_mark(rec: LoaderRecorder, loader: Any, flush: bool = True,
              setting: Setting | None = None, mid: bool = False,
              fresh_pool: bool = False, persists: bool = False) -> Mark:
    """The loader's counters now, its recorder flushed first (unless it just was);
    `setting`: the loader's settings, when the loader is not at hand; mid: taken
    mid-epoch, after the loader's own iter() (any iter() after it is another loader's);
    fresh_pool: the iter() to come starts a new pool; persists: a persistent one."""
    if flush:
        rec.flush()
    with rec.lock:
        step_s, counts = rec.step_h.sum, rec.fetch_h.counts.copy()
        steps = rec.step_h.counts.copy()
    setting = setting if setting is not None else setting_of(loader)
    return Mark(setting, perf_counter_ns(), rec.batches, rec.samples, step_s,
                counts, _times(rec.workers.proc_figures()), rec.iters, cpu_ns=process_time_ns(),
                fetch_cpu=(rec.fetch_cpu_ns, rec.fetch_cpu_n),
                loop_sched=loop_sched(rec.loop_tid), step_counts=steps,
                ticks=machine_ticks() if setting.workers == 0 else None,  # for _load only
                own_iters=0 if mid else 1, fresh_pool=fresh_pool and not mid,
                persists=persists and fresh_pool and not mid)


def epoch_since(rec: LoaderRecorder, mark: Mark, name: str, flush: bool = True,
                end_ns: int | None = None) -> Epoch | None:
    """What the epoch since `mark` measured, up to the last batch (or end_ns); None when
    it cannot be judged (module docstring)."""
    if flush:
        rec.flush()
    end = rec.last_batch_ns if end_ns is None else end_ns
    if rec.iters > mark.iters + mark.own_iters:  # another loader of this name ran in it
        once.problem(f"tune-shared:{name}", "dataloader %r: the tuner cannot judge "
                     "an epoch while another loader of the same name runs in it (their "
                     "figures add up); give each loader its own name", log_name(name))
        return None
    batches = rec.batches - mark.batches
    if batches < MIN_BATCHES or end <= mark.t_ns:
        return None
    wall = (end - mark.t_ns) / 1e9
    with rec.lock:
        step_s = rec.step_h.sum - mark.step_s
        counts = rec.fetch_h.counts - mark.fetch_counts
        bounds = rec.fetch_h.bounds
    known = rec.samples_known
    done = rec.samples - mark.samples if known else batches
    fig = rec.workers.proc_figures()  # read once for the shares and the memory
    now = _times(fig)
    before = mark.proc
    if before == (None, None, None) and None not in now:
        before = (0, 0, 0)  # no worker sampled at the mark: the sums began at 0 since
    shares: list[float | None] = [None, None, None]
    spent: list[int] | None = None
    if None not in now and None not in before:
        spent = [int(a) - int(b) for a, b in zip(now, before, strict=True)]  # type: ignore[arg-type]
        total = sum(spent)
        if total > 0:
            shares = [s / total for s in spent]
        else:
            spent = None
    # The stall from the first batch on: a pool's start is its own figure, and more
    # workers would not shorten it (the rate, samples over the whole wall, counts it).
    # From the mark, not from iter(): what ran in iter() before the mark is in neither.
    first = rec.first_at_ns if mark.t_ns < rec.first_at_ns <= end else mark.t_ns
    steady = max(1e-9, (end - first) / 1e9)
    active = rec.workers.active or 0
    to_come = _to_come(fig, active, rec.dataset_objects)
    each = _worker_bytes(fig, active)
    # A new pool's start: the wait for the first batch past a steady batch's time (what a
    # kept pool, whose first batch still takes one, saves).
    start_s = (max(0.0, (first - mark.t_ns) / 1e9 - (end - first) / 1e9 / max(1, batches - 1))
               if mark.fresh_pool and first > mark.t_ns else None)
    epoch = Epoch(mark.setting, done / wall, max(0.0, min(1.0, 1 - step_s / steady)),
                  shares[0], shares[1], shares[2],
                  None if each is None else each + to_come,
                  rec.batch_bytes if rec.batch_bytes >= 0 else None,
                  burstiness(counts, bounds), "samples" if known else "batches",
                  _load(rec, mark, batches, wall, step_s, spent), to_come,
                  rec.dataset_objects[0].attribute if rec.dataset_objects else "",
                  start_s, None if start_s is None else start_s / wall)
    log.debug("dataloader %r: %d batches in %.2f s, to be judged: %s", log_name(name),
              batches, wall, epoch)
    return epoch


def _load(rec: LoaderRecorder, mark: Mark, batches: int, wall: float, step_s: float,
          spent: list[int] | None) -> Load | None:
    """Per-batch figures for the model since `mark`; None where not measured: workers
    whose running and blocked times were not read, or a fetch without workers whose CPU
    time was not (an iterator built before the tuner started)."""
    cpu_s = (process_time_ns() - mark.cpu_ns) / 1e9
    loop_s = step_s / batches
    if mark.setting.workers == 0:
        fetch_cpu_ns, fetch_n = (rec.fetch_cpu_ns - mark.fetch_cpu[0],
                                 rec.fetch_cpu_n - mark.fetch_cpu[1])
        if fetch_n < max(1, batches - 1):  # the fetch being read now is not counted yet
            return None
        fetch_s = max(1e-9, (wall - step_s) / batches)
        ran_cpu = fetch_cpu = min(fetch_s, fetch_cpu_ns / 1e9 / fetch_n)
        # Time the loop thread waited in the run queue is neither work nor blocking: the
        # fetch's share of it (in proportion to its CPU time) is not time a batch takes
        # to make.
        now, before = loop_sched(rec.loop_tid), mark.loop_sched
        if now is not None and before is not None:
            ran, queued = now[0] - before[0], now[1] - before[1]
            if ran > 0 and queued >= 0:
                fetch_s = max(fetch_cpu, fetch_s - fetch_cpu * queued / ran)
        # Time the hypervisor took from it (core/facts/cores.py) is a batch's CPU cost.
        stolen = stolen_per_run(mark.ticks, machine_ticks())
        if stolen:
            fetch_cpu = min(fetch_s, fetch_cpu * (1 + stolen))
        return Load(fetch_s, fetch_cpu, loop_s, max(0.0, cpu_s / batches - ran_cpu))
    if spent is None:
        return None
    running, _, blocked = spent
    fetch_s = (running + blocked) / 1e9 / batches
    if fetch_s <= 0:
        return None
    return Load(fetch_s, min(fetch_s, running / 1e9 / batches), loop_s, cpu_s / batches)


def paused(rec: LoaderRecorder, mark: Mark, seconds: float) -> bool:
    """Whether a step longer than about `seconds` (the first step bucket bound at or
    over it) ran since `mark`: the loop paused (validation, a checkpoint), so the window
    says nothing of the loader's rate."""
    if mark.step_counts is None:
        return False
    i = int(np.searchsorted(np.asarray(rec.step_h.bounds), seconds, side="left"))
    with rec.lock:
        now = int(rec.step_h.counts[i + 1:].sum())
    return now > int(mark.step_counts[i + 1:].sum())


def loop_sched(tid: int) -> tuple[int, int] | None:
    """A thread of this process's running and run-queue nanoseconds (schedstat), or None
    (no thread id yet, or unreadable)."""
    if not tid:
        return None
    try:
        with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
            run, wait = f.read().split()[:2]
        return int(run), int(wait)
    except (OSError, ValueError):
        return None


def burstiness(counts: np.ndarray, bounds: tuple[float, ...]) -> float | None:
    """The 95th percentile of the waits over their median, from histogram bucket counts
    (upper bounds); None when either falls past the last bound or no wait was seen."""
    total = int(counts.sum())
    if total <= 0:
        return None
    cum = np.cumsum(counts)
    p50 = int(np.searchsorted(cum, 0.5 * total))
    p95 = int(np.searchsorted(cum, 0.95 * total))
    if p95 >= len(bounds):
        return None
    if bounds[p95] < BURST_FLOOR:
        return 1.0  # waits this short are no burst, whatever their ratio
    return bounds[p95] / bounds[p50]


def _times(fig: Figures | None) -> tuple[int | None, int | None, int | None]:
    """The workers' running, waiting-for-a-CPU and blocked nanoseconds so far, the
    steal estimated counted as running (module docstring)."""
    if fig is None:
        return None, None, None
    if fig.stolen_ns and fig.running_ns is not None and fig.waiting_ns is not None:
        return fig.running_ns + fig.stolen_ns, fig.waiting_ns - fig.stolen_ns, fig.blocked_ns
    return fig.running_ns, fig.waiting_ns, fig.blocked_ns


def _worker_bytes(fig: Figures | None, active: int) -> int | None:
    """The memory one worker takes: PSS per live worker, else the largest worker's RSS,
    else (no worker read yet) the training process's own RSS."""
    if fig is not None and active and fig.pss_bytes:
        return fig.pss_bytes // active
    if fig is not None and fig.max_rss_bytes:
        return fig.max_rss_bytes
    return _own_rss()


def _to_come(fig: Figures | None, active: int, held: tuple[Container, ...]) -> int:
    """Memory each live worker will still take copying the dataset's largest container
    of Python objects as it reads it (cowscan.py), while their private memory is seen to
    grow (memgrowth.py): its size less what a worker has grown since its start. 0 without
    such growth, and where the memory one worker takes is not its PSS (an RSS, the main
    process's above all, counts the container already)."""
    if (fig is None or not active or not fig.pss_bytes or not held
            or not fig.private_growth or fig.private_growth <= 0):
        return 0
    return max(0, held[0].bytes - fig.private_grown_bytes // active)


def _own_rss() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None
