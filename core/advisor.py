"""How many DataLoader workers a rank can use: one advisor for the loader's setup warnings
and for the doctor, so that the two never disagree.

The cores a process may use are the fewest of its physical cores, its CPU affinity mask
and its cgroup CPU quota (a 2-CPU container on a 16-core host has 2). Every rank on the
machine shares them (torchrun's LOCAL_WORLD_SIZE; the ranks one exporter instance sees),
so each rank's workers get an equal part, and without a GPU the training loop needs one
of that part for itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dataloader_exporter.core.facts.cores import cpu_affinity, cpu_quota, physical_cores

# Workers past which more stop helping, by where samples come from: local disks saturate
# early; network storage mostly waits, so more overlap more reads than there are cores.
STORAGE_WORKERS = {"ssd": 4, "rotational": 4, "nvme": 12, "network": 16}
NETWORK_PER_CORE = 4  # workers per core a rank may run when they mostly wait on the network


@dataclass(frozen=True)
class Cpu:
    """The CPU facts of one process."""

    physical: int
    quota: float | None = None  # cores the cgroup allows, None when unlimited
    affinity: int | None = None  # CPUs in the affinity mask, None when unknown

    @property
    def usable(self) -> int:
        """The cores this process may really use, at least 1."""
        cores = self.physical
        if self.affinity:
            cores = min(cores, self.affinity)
        if self.quota is not None:
            cores = min(cores, max(1, math.floor(self.quota)))
        return max(1, cores)

    def describe(self) -> str:
        """'2 cores (cgroup quota 2, 16 physical)': which limit binds, in words."""
        limits = []
        if self.quota is not None:
            limits.append(f"cgroup quota {self.quota:g}")
        if self.affinity and self.affinity < self.physical:
            limits.append(f"affinity {self.affinity}")
        limits.append(f"{self.physical} physical")
        return f"{self.usable} core{'' if self.usable == 1 else 's'} ({', '.join(limits)})"


def local_cpu() -> Cpu:
    """This process's CPU facts."""
    return Cpu(physical_cores(), cpu_quota(), cpu_affinity())


def worker_cores(cpu: Cpu, local_ranks: int, cuda: bool) -> int:
    """Cores one rank's workers can use: its share of the machine's, less one for the
    training loop when it runs on the CPU; at least 1."""
    cores = max(1, cpu.usable // max(1, local_ranks))
    return cores if cuda else max(1, cores - 1)


def worker_cap(cpu: Cpu, local_ranks: int, cuda: bool, storage: str = "unknown") -> int:
    """The most workers worth running per rank."""
    cores = worker_cores(cpu, local_ranks, cuda)
    if storage == "network":  # I/O-bound workers mostly wait: a few per core, not one
        return min(STORAGE_WORKERS["network"], NETWORK_PER_CORE * cores)
    return min(cores, STORAGE_WORKERS.get(storage, cores))


def blocked_cap(cpu: Cpu, local_ranks: int, cuda: bool, storage: str = "unknown") -> int:
    """The most workers worth running per rank when they are measured to be blocked most
    of their time (on storage, the network, locks): they overlap waits, a few per core as
    on network storage, within a local disk's own cap."""
    io_bound = min(STORAGE_WORKERS["network"],
                   NETWORK_PER_CORE * worker_cores(cpu, local_ranks, cuda))
    return min(io_bound, STORAGE_WORKERS.get(storage, io_bound))


def advised_workers(workers: int, starved: bool, cpu: Cpu, local_ranks: int, cuda: bool,
                    storage: str = "unknown") -> int:
    """num_workers for one rank: down to the cap when above it, up to it when starved."""
    cap = worker_cap(cpu, local_ranks, cuda, storage)
    if workers > cap and storage != "network":
        return cap
    if starved and workers < cap:
        return cap
    return workers


def too_many_workers(workers: int, cpu: Cpu, local_ranks: int) -> bool:
    """Whether every local rank's workers together outnumber the usable cores."""
    return workers * max(1, local_ranks) > cpu.usable
