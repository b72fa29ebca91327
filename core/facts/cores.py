"""CPU cores: physical cores, the cores a cgroup CPU quota allows, and the affinity mask."""

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
