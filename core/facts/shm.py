"""The shared-memory filesystem (/dev/shm) that DataLoader workers pass batches through."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SHM_PATH = "/dev/shm"


@dataclass(frozen=True)
class ShmSpace:
    path: str
    size: int
    used: int
    free: int  # available to unprivileged writers


def read_shm(path: str = SHM_PATH, statvfs: Callable[[str], Any] = os.statvfs) -> ShmSpace:
    """Size, used and free bytes of the filesystem at `path`; OSError when unreadable."""
    st = statvfs(path)
    return ShmSpace(path, st.f_blocks * st.f_frsize, (st.f_blocks - st.f_bfree) * st.f_frsize,
                    st.f_bavail * st.f_frsize)


def shm_space(path: str = SHM_PATH) -> ShmSpace | None:
    """read_shm(), or None when the filesystem cannot be read."""
    try:
        return read_shm(path)
    except OSError:
        return None
