"""The bands that judge a figure, written once: the doctor's verdicts, the straggler rule,
the alerts' thresholds, the dashboards' colours and the /dev/shm sizing all read them."""

from __future__ import annotations

import math

# Share of the loop's time spent waiting for input (fetch wait over the batch period).
INPUT_BOUND = 0.20  # at or over: input-bound (the GPU starves); the alert's threshold
MODERATE = 0.05  # at or over: moderately input-bound
# A rank whose wait exceeds the job's median by this share of the batch period or more is
# an input straggler: the "moderately input-bound" band, spent by every other rank.
STRAGGLER = MODERATE

# GPU utilization: under GPU_IDLE with input-bound stalls the GPU is starving (the alert);
# GPU_BUSY and over is a GPU kept busy.
GPU_IDLE = 0.6
GPU_BUSY = 0.8

# Workers' wall time runnable but not running: on an uncrowded machine the run-queue delay
# is a few percent; a quarter means each worker gets at most three quarters of its CPU.
CPU_CONTENTION = 0.25

# Of total memory (host, or the container's limit) kept available: below it the host is
# under memory pressure (the alert) and the doctor adds no workers that would take it.
MEMORY_RESERVE = 0.10

# Shared memory the batches in flight may take, with this margin for torch's own use.
SHM_SAFETY = 1.5
SHM_HEADROOM = 1.25  # a suggested --shm-size leaves this much over the need
_GiB = 1024 ** 3


def shm_in_flight(batch_bytes: float, prefetch: int, workers: int, local_ranks: int = 1
                  ) -> float:
    """Shared memory the batches in flight may take: batch x prefetch x workers x ranks x 1.5.

    The one formula behind the loader's preflight warning and the doctor's findings.
    """
    return batch_bytes * prefetch * workers * local_ranks * SHM_SAFETY


def shm_size_advice(needed: float) -> str:
    """A --shm-size (whole GiB, at least 1g) with headroom for `needed` bytes."""
    return f"{max(1, math.ceil(needed * SHM_HEADROOM / _GiB))}g"
