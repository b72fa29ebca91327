"""ShmCollector with an injected statvfs and HostCollector over fake /proc and cgroup trees."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dataloader_exporter.core import catalogue as c
from dataloader_exporter.exporter.collectors.host import HostCollector
from dataloader_exporter.exporter.collectors.shm_usage import ShmCollector

# A 64 MiB /dev/shm (Docker's default) in 4 KiB blocks: 4096 blocks free, 4000 of them
# available to unprivileged users.
SMALL_SHM = os.statvfs_result((4096, 4096, 16384, 4096, 4000, 1000, 900, 900, 0, 255))

MEMINFO = """\
MemTotal:       16384000 kB
MemFree:         1000000 kB
MemAvailable:    8192000 kB
SwapTotal:          2048 kB
SwapFree:           1024 kB
HugePages_Total:       0
"""
HOST_TOTAL = 16384000 * 1024


def registered(collector: ShmCollector | HostCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def log_lines(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_host(tmp_path: Path, cgroup_files: dict[str, str] | None = None,
              meminfo: str | None = MEMINFO, self_cgroup: str | None = None) -> HostCollector:
    """A HostCollector over tmp_path/proc and tmp_path/cgroup holding the given files."""
    if meminfo is not None:
        write(tmp_path / "proc" / "meminfo", meminfo)
    if self_cgroup is not None:
        write(tmp_path / "proc" / "self" / "cgroup", self_cgroup)
    (tmp_path / "cgroup").mkdir()
    for name, text in (cgroup_files or {}).items():
        write(tmp_path / "cgroup" / name, text)
    return HostCollector(proc_root=str(tmp_path / "proc"), cgroup_root=str(tmp_path / "cgroup"))


def assert_promtool_accepts(promtool: str, registry: CollectorRegistry) -> None:
    exposition = generate_latest(registry)
    assert exposition
    result = subprocess.run([promtool, "check", "metrics"], input=exposition,
                            capture_output=True, timeout=30, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


# --- shm ----------------------------------------------------------------------------------
def test_shm_sizes_come_from_statvfs_in_bytes() -> None:
    seen: list[str] = []

    def statvfs(path: str) -> os.statvfs_result:
        seen.append(path)
        return SMALL_SHM

    collector = ShmCollector(path="/fake/shm", statvfs=statvfs)
    registry = registered(collector)
    labels = {"path": "/fake/shm"}
    assert registry.get_sample_value(c.SHM_SIZE.name, labels) == 64 * 2**20
    assert registry.get_sample_value(c.SHM_USED.name, labels) == (16384 - 4096) * 4096
    assert registry.get_sample_value(c.SHM_FREE.name, labels) == 4000 * 4096
    assert set(seen) == {"/fake/shm"}
    assert collector.up is True
    assert collector.errors == 0


def test_a_missing_shm_path_emits_nothing_and_logs_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    collector = ShmCollector(path=str(tmp_path / "no-shm-here"))
    registry = registered(collector)
    for _ in range(3):
        assert generate_latest(registry) == b""
    assert collector.up is False
    assert collector.errors == 3
    assert len(log_lines(caplog, "dataloader_exporter.exporter.shm")) == 1


def test_the_real_dev_shm_has_a_positive_size() -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("this machine has no /dev/shm")
    collector = ShmCollector()
    size = registered(collector).get_sample_value(c.SHM_SIZE.name, {"path": "/dev/shm"})
    assert size is not None
    assert size > 0
    assert collector.up is True


def test_shm_exposition_passes_promtool_check_metrics(promtool: str) -> None:
    collector = ShmCollector(path="/fake/shm", statvfs=lambda _: SMALL_SHM)
    assert_promtool_accepts(promtool, registered(collector))


# --- host ---------------------------------------------------------------------------------
def test_host_memory_and_swap_come_from_meminfo_in_bytes(tmp_path: Path) -> None:
    collector = fake_host(tmp_path)
    registry = registered(collector)
    assert registry.get_sample_value(c.HOST_MEMORY_TOTAL.name) == HOST_TOTAL
    assert registry.get_sample_value(c.HOST_MEMORY_AVAILABLE.name) == 8192000 * 1024
    assert registry.get_sample_value(c.HOST_SWAP_USED.name) == 1024 * 1024
    assert collector.up is True
    assert collector.errors == 0


def test_cgroup_v2_limit_and_usage_are_reported(tmp_path: Path) -> None:
    registry = registered(fake_host(
        tmp_path, {"memory.max": "4294967296\n", "memory.current": "1073741824\n"}))
    assert registry.get_sample_value(c.CGROUP_MEMORY_LIMIT.name) == 4 * 2**30
    assert registry.get_sample_value(c.CGROUP_MEMORY_USAGE.name) == 2**30


def test_cgroup_v2_max_means_no_limit_series(tmp_path: Path) -> None:
    collector = fake_host(tmp_path, {"memory.max": "max\n", "memory.current": "1073741824\n"})
    registry = registered(collector)
    assert registry.get_sample_value(c.CGROUP_MEMORY_LIMIT.name) is None
    assert registry.get_sample_value(c.CGROUP_MEMORY_USAGE.name) == 2**30
    assert collector.up is True


def test_cgroup_v1_limit_and_usage_are_reported(tmp_path: Path) -> None:
    registry = registered(fake_host(tmp_path, {
        "memory/memory.limit_in_bytes": "2147483648\n",
        "memory/memory.usage_in_bytes": "536870912\n",
    }))
    assert registry.get_sample_value(c.CGROUP_MEMORY_LIMIT.name) == 2 * 2**30
    assert registry.get_sample_value(c.CGROUP_MEMORY_USAGE.name) == 512 * 2**20


@pytest.mark.parametrize("limit", ["9223372036854771712", str(HOST_TOTAL + 4096)])
def test_cgroup_v1_huge_or_above_host_limit_means_no_limit_series(
        tmp_path: Path, limit: str) -> None:
    registry = registered(fake_host(tmp_path, {
        "memory/memory.limit_in_bytes": limit + "\n",
        "memory/memory.usage_in_bytes": "536870912\n",
    }))
    assert registry.get_sample_value(c.CGROUP_MEMORY_LIMIT.name) is None
    assert registry.get_sample_value(c.CGROUP_MEMORY_USAGE.name) == 512 * 2**20


def test_the_process_own_cgroup_is_preferred_to_the_root(tmp_path: Path) -> None:
    registry = registered(fake_host(
        tmp_path,
        {"memory.max": "max\n", "memory.current": "999\n",
         "kubepods/pod1/memory.max": "1073741824\n", "kubepods/pod1/memory.current": "4096\n"},
        self_cgroup="0::/kubepods/pod1\n"))
    assert registry.get_sample_value(c.CGROUP_MEMORY_LIMIT.name) == 2**30
    assert registry.get_sample_value(c.CGROUP_MEMORY_USAGE.name) == 4096


def test_an_own_cgroup_outside_the_namespace_falls_back_to_the_root(tmp_path: Path) -> None:
    registry = registered(fake_host(
        tmp_path, {"memory.max": "1073741824\n", "memory.current": "4096\n"},
        self_cgroup="0::/../../system.slice/docker.service\n"))
    assert registry.get_sample_value(c.CGROUP_MEMORY_LIMIT.name) == 2**30


def test_no_cgroup_files_means_no_cgroup_series_and_no_error(tmp_path: Path) -> None:
    collector = fake_host(tmp_path)
    registry = registered(collector)
    assert registry.get_sample_value(c.CGROUP_MEMORY_LIMIT.name) is None
    assert registry.get_sample_value(c.CGROUP_MEMORY_USAGE.name) is None
    assert collector.up is True
    assert collector.errors == 0


def test_unreadable_meminfo_is_an_error_logged_once_but_cgroup_is_still_reported(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    collector = fake_host(tmp_path, {"memory.max": "max\n", "memory.current": "4096\n"},
                          meminfo=None)
    registry = registered(collector)
    for _ in range(3):
        generate_latest(registry)
    assert registry.get_sample_value(c.HOST_MEMORY_TOTAL.name) is None
    assert registry.get_sample_value(c.CGROUP_MEMORY_USAGE.name) == 4096
    assert collector.up is False
    assert collector.errors == 5  # every scrape, get_sample_value's included
    assert len(log_lines(caplog, "dataloader_exporter.exporter.host")) == 1


def test_the_real_proc_reports_a_positive_memtotal() -> None:
    if not os.path.exists("/proc/meminfo"):
        pytest.skip("this machine has no /proc/meminfo")
    collector = HostCollector()
    total = registered(collector).get_sample_value(c.HOST_MEMORY_TOTAL.name)
    assert total is not None
    assert total > 0
    assert collector.up is True


def test_host_exposition_passes_promtool_check_metrics(tmp_path: Path, promtool: str) -> None:
    assert_promtool_accepts(promtool, registered(fake_host(
        tmp_path, {"memory.max": "4294967296\n", "memory.current": "1073741824\n"})))


def test_the_cores_and_memory_facts_read_what_psutil_reads_on_this_machine(tmp_path: Path
                                                                         ) -> None:
    """The core reads /sys and /proc itself (it imports the standard library only): the
    figures psutil gives here, and a /proc/meminfo without MemAvailable (kernels < 3.14)."""
    import psutil

    from dataloader_exporter.core.facts.cores import physical_cores
    from dataloader_exporter.core.facts.memory import host_memory

    assert physical_cores() == (psutil.cpu_count(logical=False) or os.cpu_count())
    total, available = host_memory()
    assert total == psutil.virtual_memory().total
    assert 0 < available <= total
    old = tmp_path / "meminfo"
    old.write_text("MemTotal:  1000 kB\nMemFree:  100 kB\nBuffers:  20 kB\nCached:  30 kB\n")
    assert host_memory(str(old)) == (1024000, 150 * 1024)
    assert physical_cores(str(tmp_path)) == os.cpu_count()  # no topology: logical CPUs


def test_the_machines_steal_is_read_as_psutil_reads_it_and_turned_into_time_lost_per_run(
        tmp_path: Path) -> None:
    """/proc/stat's busy and stolen ticks, as psutil.cpu_times() reads them here; the time
    a process loses to steal per ns it runs is s / (1 - s) for a stolen share s of the
    CPUs' busy time, bounded, and unknown without two readings or any work between."""
    import psutil

    from dataloader_exporter.core.facts.cores import MAX_STOLEN, machine_ticks, stolen_per_run

    tick = os.sysconf("SC_CLK_TCK")
    before = psutil.cpu_times()
    ticks = machine_ticks()
    after = psutil.cpu_times()
    assert ticks is not None
    assert before.steal * tick - 1 <= ticks[1] <= after.steal * tick + 1
    def busy(t: Any) -> float:
        return float(t.user + t.nice + t.system + t.irq + t.softirq) * tick

    assert busy(before) - 1 <= ticks[0] <= busy(after) + 1
    stat = tmp_path / "stat"
    stat.write_text("cpu  600 0 300 5000 10 50 50 1000 0 0\ncpu0 600 0 300 5000 10 50 50 1000\n")
    assert machine_ticks(str(stat)) == (1000, 1000)
    assert stolen_per_run((0, 0), (1000, 1000)) == 1.0  # half lost: as long again
    assert stolen_per_run((0, 0), (1000, 0)) == 0.0  # bare metal: steal stays 0
    assert stolen_per_run((0, 0), (0, 5000)) == MAX_STOLEN / (1 - MAX_STOLEN)
    assert stolen_per_run(None, (1000, 0)) is None
    assert stolen_per_run((1000, 0), (1000, 0)) is None  # no work in between
    stat.write_text("intr 1 2 3\n")
    assert machine_ticks(str(stat)) is None
    assert machine_ticks(str(tmp_path / "none")) is None
