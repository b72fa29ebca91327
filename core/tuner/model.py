"""A model of an input pipeline: the batches/s that n workers give, from what one setting
measured. Pure. The tuner's moves (core/tuner/rules.py) and the doctor's num_workers
advice both come from it.

Per batch, under the setting measured:

- fetch_s: the wall time one worker (or, with none, the loop) spends making a batch,
  running or blocked (on storage, the network, a lock), not waiting for a CPU;
- fetch_cpu_s: the CPU time of that;
- loop_s: the loop's time between two fetches (its step);
- loop_cpu_s: the CPU the training process spends per batch outside the fetch (None:
  not measured; the whole step is then counted as CPU, which never over-promises).

With no workers the fetch and the step take turns: 1 / (fetch_s + loop_s). With n
workers, three limits: what n workers make (n / fetch_s), what the loop takes
(1 / loop_s), and the cores this rank may use, shared by the workers' CPU and the loop's
(cpus / (fetch_cpu_s + loop_cpu_s)). A worker blocked most of its time needs a small
share of a core, so workers past the core count are normal for blocked workers: the
budget is CPU time, not a worker per core.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Blocked workers over the count that exactly keeps up: waits on storage vary, and among
# many workers a batch takes longer than the fetch measured alone (bench/tuner.py's storage
# classes: the best fixed counts are about 1.5x the count that exactly keeps up). CPU-bound
# workers get none: past the cores they only queue for a CPU.
HEADROOM = 1.5
MAX_PER_CPU = 16  # blocked workers per core at most, whatever the model says
MAX_WORKERS = 128  # per rank: beyond, a pool's start and memory outweigh the overlap
CPU_BOUND = 0.5  # a worker on a CPU this share of its time or more: no more than the cores


@dataclass(frozen=True)
class Load:
    """Per-batch seconds measured under one setting (module docstring)."""

    fetch_s: float
    fetch_cpu_s: float
    loop_s: float
    loop_cpu_s: float | None = None

    @property
    def cpu_share(self) -> float:
        """The share of a core one busy worker takes (1: CPU-bound, near 0: blocked)."""
        return min(1.0, self.fetch_cpu_s / self.fetch_s) if self.fetch_s > 0 else 1.0

    def line(self) -> str:
        """The figures, for a log line."""
        loop_cpu = "" if self.loop_cpu_s is None else f", {self.loop_cpu_s * 1e3:.1f} ms CPU"
        return (f"a batch takes {self.fetch_s * 1e3:.1f} ms to make ({self.cpu_share:.0%} of "
                f"it on a CPU), the loop {self.loop_s * 1e3:.1f} ms{loop_cpu}")


def ceiling(cpus: float) -> int:
    """The most workers the model may ask for on `cpus` cores."""
    return max(1, min(MAX_WORKERS, math.ceil(MAX_PER_CPU * max(cpus, 1.0))))


def predict(load: Load, workers: int, cpus: float) -> float:
    """Batches/s with `workers` workers on `cpus` cores (module docstring)."""
    if workers <= 0:
        return 1.0 / max(1e-9, load.fetch_s + load.loop_s)
    loop_cpu = load.loop_s if load.loop_cpu_s is None else load.loop_cpu_s
    limits = [workers / max(1e-9, load.fetch_s), cpus / max(1e-9, load.fetch_cpu_s + loop_cpu)]
    if load.loop_s > 0:
        limits.append(1.0 / load.loop_s)
    return min(limits)


def plateau(load: Load, cpus: float) -> float:
    """The most batches/s any number of workers can give: the loop's or the cores' limit."""
    return predict(load, 1 << 30, cpus)


def choose(load: Load, cpus: float, cap: int | None = None) -> int:
    """The smallest worker count predicted to reach the plateau (with HEADROOM for the
    share of their time the workers are blocked), CPU-bound workers (CPU_BOUND) no more
    than the cores, at most
    `cap` (or ceiling(cpus)); 0 when no count is predicted faster than none at all by
    a tenth (the cores or the loop are the limit, not the fetch)."""
    most = ceiling(cpus) if cap is None else max(0, min(cap, ceiling(cpus)))
    if load.cpu_share >= CPU_BOUND:  # past the cores they would only queue for one
        most = min(most, max(1, math.ceil(cpus)))
    if most == 0:
        return 0
    rate = plateau(load, cpus)
    needed = rate * load.fetch_s * (1 + (HEADROOM - 1) * (1 - load.cpu_share))
    want = max(1, min(most, math.ceil(needed - 1e-6)))
    if predict(load, want, cpus) < 1.1 * predict(load, 0, cpus):
        return 0
    return want
