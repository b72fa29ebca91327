"""CPU cores: physical cores, the cores a cgroup CPU quota allows, the affinity mask, and the
time a hypervisor took them (steal)."""

from __future__ import annotations

import os
import re
from pathlib import Path

CPU_ROOT = "/sys/devices/system/cpu"


def physical_cores(cpu_root: str = CPU_ROOT) -> int:
    """Physical cores (logical CPUs where the kernel does not say), at least 1.

    The distinct sibling lists of the logical CPUs, as psutil.cpu_count(logical=False)
    reads them on Linux: read here so that the core stays standard-library only."""
    cores = set()
    for cpu in Path(cpu_root).glob("cpu[0-9]*"):
        if not re.fullmatch(r"cpu[0-9]+", cpu.name):
            continue
        for name in ("core_cpus_list", "thread_siblings_list"):
            try:
                cores.add((cpu / "topology" / name).read_text().strip())
                break
            except OSError:
                continue
    return len(cores) or os.cpu_count() or 1


def cpu_quota(cgroup_root: str = "/sys/fs/cgroup") -> float | None:
    """Cores allowed by the cgroup CPU quota (v2 cpu.max, v1 cfs), None if unlimited."""
    root = Path(cgroup_root)
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        q = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        p = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if q <= 0 or p <= 0 else q / p
    except (OSError, ValueError):
        return None


def cpu_affinity() -> int | None:
    """CPUs this process may run on (taskset, cpuset, Kubernetes' static CPU manager);
    None where the platform cannot tell."""
    try:
        return len(os.sched_getaffinity(0)) or None
    except (AttributeError, OSError):
        return None


# Steal: on a virtual machine a thread can be on its (virtual) CPU and not run, the
# hypervisor having given the physical core to another guest. The kernel counts that as
# steal (the 8th figure of /proc/stat's "cpu" line), neither as the thread's CPU time nor
# as its run-queue wait, so a CPU-bound process on a busy host looks blocked, as if it
# waited on storage. Steal is known for the machine only: a process that ran R ns while
# the CPUs lost a share s of their busy time to steal is taken to have lost R s / (1 - s)
# more, waiting for a CPU.
MAX_STOLEN = 0.9  # a stolen share past this is taken as this: the estimate's bound


def machine_ticks(path: str = "/proc/stat") -> tuple[int, int] | None:
    """The machine's busy and stolen CPU ticks since boot (user, nice, system, irq,
    softirq; steal), all CPUs together; None when /proc/stat cannot be read. Steal
    stays 0 outside a virtual machine."""
    try:
        with open(path, "rb") as f:
            line = f.readline()
    except OSError:
        return None
    parts = line.split()
    if len(parts) < 9 or parts[0] != b"cpu":
        return None
    try:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, parts[1:9])
    except ValueError:
        return None
    return user + nice + system + irq + softirq, steal


def stolen_per_run(before: tuple[int, int] | None,
                   now: tuple[int, int] | None) -> float | None:
    """The ns a process lost to steal per ns it ran, between two machine_ticks(); None
    when either is unknown or the CPUs did no work in between."""
    if before is None or now is None:
        return None
    busy, steal = now[0] - before[0], now[1] - before[1]
    if busy < 0 or steal < 0 or busy + steal <= 0:
        return None
    share = min(MAX_STOLEN, steal / (busy + steal))
    return share / (1 - share)


def stolen_ns(running: int, blocked: int, per_run: float | None) -> int:
    """The ns of `blocked` time that `running` ns on a CPU lost to steal at `per_run`
    (stolen_per_run; None: unknown, nothing)."""
    return min(max(0, blocked), int(max(0, running) * (per_run or 0.0)))
