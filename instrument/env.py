"""Facts about where the loader runs: rank, cores, /dev/shm."""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

SHM_PATH = "/dev/shm"


def current_rank() -> str:
    """torch.distributed's rank when initialised, else $RANK, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return str(dist.get_rank())
    except Exception:
        pass
    rank = os.environ.get("RANK", "").strip()
    return rank if rank.isdigit() else "0"


def physical_cores() -> int:
    """Physical cores (logical when psutil cannot tell), at least 1."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


@dataclass(frozen=True)
class ShmSpace:
    path: str
    size: int
    free: int


def shm_space(path: str = SHM_PATH) -> ShmSpace | None:
    """Size and free bytes of the shared-memory filesystem, None if unreadable."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return ShmSpace(path, st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
