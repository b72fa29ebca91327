"""What one epoch of a tuned loader measured, as the tuner judges it (core.tuner_rules.Epoch).

A mark holds the loader's counters at an epoch's iter(); the epoch since a mark is read
from the same counters at the next iter() (or, in a long epoch, while it runs):

- samples (or batches) per second and the input stall, over the wall time from iter() to
  the last batch handed out, so a worker pool's start (and its rebuild) counts;
- the workers' running / waiting-for-a-CPU / blocked shares (procstat.py) over the epoch;
- the memory one worker takes (PSS, else its largest RSS; with no worker yet, the main
  process's RSS, which a forked worker can at most take), and a batch's bytes;
- the fetch waits' burstiness (95th percentile over the median, from the histogram).

An epoch of fewer than MIN_BATCHES batches, or one in which another loader of the same
name ran (their figures add up), is not judged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any

import numpy as np

from dataloader_exporter.core.settings import log_name
from dataloader_exporter.core.tuner_rules import Epoch, Setting

from .envsettings import once
from .hotpath_recorder import LoaderRecorder
from .procstat import Figures

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


def take_mark(rec: LoaderRecorder, loader: Any) -> Mark:
    """The loader's counters now, its recorder flushed first."""
    rec.flush()
    with rec.lock:
        step_s, counts = rec.step_h.sum, rec.fetch_h.counts.copy()
    return Mark(setting_of(loader), perf_counter_ns(), rec.batches, rec.samples, step_s,
                counts, _times(rec.workers.proc_figures()), rec.iters)


def epoch_since(rec: LoaderRecorder, mark: Mark, name: str, flush: bool = True,
                end_ns: int | None = None) -> Epoch | None:
    """What the epoch since `mark` measured, up to the last batch (or end_ns); None when
    it cannot be judged (module docstring)."""
    if flush:
        rec.flush()
    end = rec.last_batch_ns if end_ns is None else end_ns
    if rec.iters > mark.iters + 1:  # another loader of this name ran in the window
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
    if None not in now and None not in before:
        spent = [int(a) - int(b) for a, b in zip(now, before, strict=True)]  # type: ignore[arg-type]
        total = sum(spent)
        if total > 0:
            shares = [s / total for s in spent]
    return Epoch(mark.setting, done / wall, max(0.0, min(1.0, 1 - step_s / wall)),
                 shares[0], shares[1], shares[2],
                 _worker_bytes(fig, rec.workers.active or 0),
                 rec.batch_bytes if rec.batch_bytes >= 0 else None,
                 burstiness(counts, bounds), "samples" if known else "batches")


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
    """The workers' running, waiting-for-a-CPU and blocked nanoseconds so far."""
    if fig is None:
        return None, None, None
    return fig.running_ns, fig.waiting_ns, fig.blocked_ns


def _worker_bytes(fig: Figures | None, active: int) -> int | None:
    """The memory one worker takes: PSS per live worker, else the largest worker's RSS,
    else (no worker read yet) the training process's own RSS."""
    if fig is not None and active and fig.pss_bytes:
        return fig.pss_bytes // active
    if fig is not None and fig.max_rss_bytes:
        return fig.max_rss_bytes
    return _own_rss()


def _own_rss() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None
