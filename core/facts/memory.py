"""Host memory: total and available bytes, from /proc/meminfo."""

from __future__ import annotations

import os

MEMINFO = "/proc/meminfo"


def host_memory(meminfo: str = MEMINFO) -> tuple[int, int]:
    """(total, available) bytes of host memory, as psutil.virtual_memory() gives them on
    Linux: MemTotal and MemAvailable (free, buffers and page cache before kernel 3.14).
    Raises OSError where there is no /proc/meminfo."""
    fields: dict[str, int] = {}
    with open(meminfo, encoding="ascii") as f:
        for line in f:
            name, _, rest = line.partition(":")
            value = rest.split()
            if value and value[0].isdigit():
                fields[name] = int(value[0]) * (1024 if value[1:] == ["kB"] else 1)
    total = fields.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = fields.get("MemAvailable")
    if available is None:
        available = sum(fields.get(k, 0) for k in ("MemFree", "Buffers", "Cached"))
    return total, available
