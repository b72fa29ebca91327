"""Memory of the host (/proc/meminfo) and of the container's memory cgroup.

A DataLoader with many workers multiplies the dataset's memory by copy-on-write and
pinned buffers; when the container's cgroup limit is hit the kernel kills a worker
("DataLoader worker killed by signal: Killed"). These gauges show how close that is.
Both cgroup v2 (memory.max, memory.current) and v1 (memory.limit_in_bytes,
memory.usage_in_bytes) are read; the process's own cgroup from /proc/self/cgroup is
tried first, then the root of the mounted cgroup filesystem, which is what a container
sees. Roots are injected so tests can use a temporary directory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import cast

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric as Family

from dataloader_exporter.core import catalogue as c
from dataloader_exporter.core.facts.cgroup import limits, memory_files, read_value
from dataloader_exporter.core.logonce import LogOnce
from dataloader_exporter.exporter.collectors.base import family

log = logging.getLogger("dataloader_exporter.exporter.host")


def _gauge(metric: c.Metric, value: float) -> Family:
    fam = cast(GaugeMetricFamily, family(metric))
    fam.add_metric([], float(value))
    return fam


def read_meminfo(path: Path) -> dict[str, int]:
    """/proc/meminfo as bytes per key ("MemTotal: 16384 kB" -> {"MemTotal": 16777216})."""
    out = {}
    for line in path.read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


class HostCollector:
    """Host memory and swap, and the memory limit and usage of the exporter's cgroup."""

    name = "host"

    def __init__(self, proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> None:
        self.proc_root = Path(proc_root)
        self.cgroup_root = Path(cgroup_root)
        self.up = False
        self.errors = 0
        self._logs = LogOnce(log)

    def collect(self) -> Iterable[Family]:
        self.up = True
        families: list[Family] = []
        total = self._collect_meminfo(families)
        self._collect_cgroup(families, total)
        yield from families

    def _fail(self, key: str, msg: str, *args: object) -> None:
        self.up = False
        self.errors += 1
        self._logs.problem(key, msg, *args)

    def _collect_meminfo(self, families: list[Family]) -> int | None:
        path = self.proc_root / "meminfo"
        try:
            mem = read_meminfo(path)
        except (OSError, ValueError) as err:
            self._fail("meminfo", "host memory metrics skipped: cannot read %s: %s", path, err)
            return None
        self._logs.cleared("meminfo", "host memory metrics: %s readable again", path)
        if "MemTotal" in mem:
            families.append(_gauge(c.HOST_MEMORY_TOTAL, mem["MemTotal"]))
        if "MemAvailable" in mem:
            families.append(_gauge(c.HOST_MEMORY_AVAILABLE, mem["MemAvailable"]))
        if "SwapTotal" in mem and "SwapFree" in mem:
            families.append(_gauge(c.HOST_SWAP_USED, mem["SwapTotal"] - mem["SwapFree"]))
        return mem.get("MemTotal")

    def _collect_cgroup(self, families: list[Family], host_total: int | None) -> None:
        files = memory_files(self.proc_root, self.cgroup_root)
        if files is None:  # not in a memory cgroup we can see: nothing to report
            return
        limit_file, usage_file = files
        try:
            limit = read_value(limit_file)
            usage = read_value(usage_file)
        except (OSError, ValueError) as err:
            self._fail("cgroup", "cgroup memory metrics skipped: %s", err)
            return
        self._logs.cleared("cgroup", "cgroup memory metrics readable again")
        if limit is not None and limits(limit, host_total):
            families.append(_gauge(c.CGROUP_MEMORY_LIMIT, limit))
        if usage is not None:
            families.append(_gauge(c.CGROUP_MEMORY_USAGE, usage))
