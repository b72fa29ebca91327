"""Facts about the local machine that the doctor weighs: cores, CPU quota, memory, storage."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs",
                        "ceph", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs", "9p", "glusterfs",
                        "fuse.glusterfs", "wekafs", "fuse.sshfs"})


@dataclass(frozen=True)
class Machine:
    physical_cores: int
    cpu_quota: float | None  # cores allowed by the cgroup, None when unlimited
    memory_total: int
    memory_available: int
    shm_size: int | None
    storage: str  # "nvme", "ssd", "rotational", "network", "unknown"
    data_path: str

    @property
    def usable_cores(self) -> int:
        cores = self.physical_cores
        if self.cpu_quota is not None:
            cores = min(cores, max(1, int(self.cpu_quota)))
        return max(1, cores)

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "usable_cores": self.usable_cores}


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


def storage_kind(path: str, mounts_file: str = "/proc/self/mounts",
                 sys_block: str = "/sys/block") -> str:
    """What the filesystem holding `path` sits on: nvme, ssd, rotational, network, unknown."""
    try:
        target = os.path.realpath(path)
        best: tuple[str, str, str] = ("", "", "")
        for line in Path(mounts_file).read_text().splitlines():
            parts = line.split()
            if len(parts) < 3:
                continue
            device, mountpoint, fstype = parts[0], parts[1].replace("\\040", " "), parts[2]
            inside = target == mountpoint or target.startswith(mountpoint.rstrip("/") + "/")
            if inside and len(mountpoint) >= len(best[1]):
                best = (device, mountpoint, fstype)
    except OSError:
        return "unknown"
    device, _, fstype = best
    if fstype in NETWORK_FS or fstype.startswith("nfs") or ":" in device:
        return "network"
    name = os.path.basename(device)
    if name.startswith("nvme"):
        return "nvme"
    base = name.rstrip("0123456789")
    if base.endswith("p") and name.startswith("mmcblk"):
        base = base[:-1]
    try:
        rotational = (Path(sys_block) / base / "queue" / "rotational").read_text().strip()
    except OSError:
        return "unknown"
    return "rotational" if rotational == "1" else "ssd"


def local_machine(data_path: str = ".", shm_path: str = "/dev/shm") -> Machine:
    """Reads this machine's facts; anything unreadable becomes None or 'unknown'."""
    vm = psutil.virtual_memory()
    try:
        st = os.statvfs(shm_path)
        shm: int | None = st.f_blocks * st.f_frsize
    except OSError:
        shm = None
    return Machine(psutil.cpu_count(logical=False) or os.cpu_count() or 1, cpu_quota(),
                   int(vm.total), int(vm.available), shm, storage_kind(data_path), data_path)
