"""What this rank may use now, as the loader tuner reads it before each decision: its
cores, the memory more workers may still take, /dev/shm free, and the workers the
open-file and process limits allow.

Read each time, never cached: a container's limit, a neighbour's memory and the other
ranks' workers change while a job runs. A figure that cannot be read is None, which
blocks growth rather than allowing it.
"""

from __future__ import annotations

import os
import resource

import torch

from dataloader_exporter.core import advisor, bands
from dataloader_exporter.core.facts.cgroup import cgroup_memory_limit, cgroup_pids_room
from dataloader_exporter.core.facts.memory import host_memory
from dataloader_exporter.core.facts.shm import SHM_PATH, shm_space
from dataloader_exporter.core.tuner.types import Budget

from ..rank import local_world_size
from ..worker_tracker import process_memory_available


def memory_budget() -> int | None:
    """Memory more workers may take: what this process's container (or the host) may
    still allocate, less bands.MEMORY_RESERVE of its limit (or of the host's memory)."""
    room = process_memory_available()
    if room is None:
        return None
    try:
        total, _ = host_memory()
        limit = cgroup_memory_limit(total)
    except Exception:  # a figure that cannot be read is unknown: it blocks growth
        return None
    return room - int(bands.MEMORY_RESERVE * (total if limit is None else limit))


FDS_PER_WORKER = 8  # descriptors a worker holds open in the training process (queues, pipes)
PIDS_PER_WORKER = 4  # a worker process and the threads it may start


def worker_limit() -> int | None:
    """More workers the open-file limit (RLIMIT_NOFILE less those open now) and the
    container's process limit (its pids cgroup) still allow, the fewer of the two; None
    when neither limits or can be read."""
    limits = []
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY:
            limits.append(max(0, (soft - len(os.listdir("/proc/self/fd"))) // FDS_PER_WORKER))
    except (OSError, ValueError):
        pass
    pids = cgroup_pids_room()
    if pids is not None:
        limits.append(pids // PIDS_PER_WORKER)
    return min(limits) if limits else None


def budget() -> Budget:
    """What this rank may use now: the share of the cores its affinity and cgroup allow
    per local rank (advisor.worker_cores; as CPU time for the model, the loop's own use
    measured rather than a core kept for it), memory_budget(), /dev/shm free and
    worker_limit()."""
    cpu = advisor.local_cpu()
    ranks = max(1, local_world_size())
    cores = advisor.worker_cores(cpu, ranks, torch.cuda.is_initialized())
    shm = shm_space(SHM_PATH)
    return Budget(cores, memory_budget(), shm.free if shm is not None else None,
                  cpu.usable / ranks, worker_limit())
