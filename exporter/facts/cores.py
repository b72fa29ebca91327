"""CPU cores: physical cores, the cores a cgroup CPU quota allows, and the affinity mask."""

from __future__ import annotations

import os
from pathlib import Path

import psutil


def physical_cores() -> int:
    """Physical cores (logical when psutil cannot tell), at least 1."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


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
