"""What the filesystem holding a path sits on: nvme, ssd, rotational, network, unknown."""

from __future__ import annotations

import os
from pathlib import Path

NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs",
                        "ceph", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs", "9p", "glusterfs",
                        "fuse.glusterfs", "wekafs", "fuse.sshfs"})


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
