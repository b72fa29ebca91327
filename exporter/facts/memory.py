"""Host memory: total and available bytes."""

from __future__ import annotations

import psutil


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory."""
    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.available)
