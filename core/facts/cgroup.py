"""The memory cgroup a process is in: its limit and usage, and the kernel's count of OOM
kills in it.

A DataLoader worker killed by the kernel's OOM killer dies of SIGKILL like one killed by
anything else; only the kernel's own count tells them apart. It counts OOM kills per
memory cgroup (v2: ``oom_kill`` in memory.events, hierarchical, every kind of OOM killer;
v1: ``oom_kill`` in memory.oom_control, kernel 4.13 and later) and for the whole machine
(``oom_kill`` in /proc/vmstat). Paths come from /proc/self/cgroup, relative to the cgroup
filesystem's mount (a container sees its own cgroup as the mount's root). Roots are
injected so tests can use fixtures.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = "/proc"
CGROUP = "/sys/fs/cgroup"


def own_cgroups(proc_root: Path, controller: str = "memory") -> tuple[str, str]:
    """This process's cgroup v2 path and v1 path for `controller` ("/" if unknown)."""
    v2 = v1 = "/"
    try:
        text = (proc_root / "self" / "cgroup").read_text()
    except OSError:
        return v2, v1
    for line in text.splitlines():
        parts = line.split(":", 2)  # hierarchy-id:controllers:path
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not path.startswith("/") or ".." in path.split("/"):
            continue  # outside our cgroup namespace: fall back to the mount's root
        if parts[0] == "0" and controllers == "":
            v2 = path
        elif controller in controllers.split(","):
            v1 = path
    return v2, v1


# cgroup v1 reports "no limit" as the largest page-aligned int64 (9223372036854771712).
V1_UNLIMITED = 2**62


def limits(limit: int | None, host_total: int | None) -> bool:
    """Whether a memory cgroup's limit limits anything: set ("max" is none), under cgroup
    v1's "no limit", and not above the host's memory."""
    return (limit is not None and limit < V1_UNLIMITED
            and (host_total is None or limit <= host_total))


def memory_files(proc_root: Path, cgroup_root: Path) -> tuple[Path, Path] | None:
    """The (limit, usage) files of our memory cgroup: v2 first, then v1; None if neither."""
    own_v2, own_v1 = own_cgroups(proc_root)
    v1_root = cgroup_root / "memory"
    layouts = (
        ([cgroup_root / own_v2.lstrip("/"), cgroup_root], "memory.max", "memory.current"),
        ([v1_root / own_v1.lstrip("/"), v1_root],
         "memory.limit_in_bytes", "memory.usage_in_bytes"),
    )
    for dirs, limit, usage in layouts:
        for d in dirs:
            if (d / limit).exists() or (d / usage).exists():
                return d / limit, d / usage
    return None


def read_value(path: Path) -> int | None:
    """A cgroup file's number; None if the file is absent or says "max" (no limit)."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return None if text == "max" else int(text)


def cgroup_memory_available(host_total: int, host_available: int, proc_root: str = PROC,
                            cgroup_root: str = CGROUP) -> int:
    """Memory this process's container may still allocate: its memory cgroup's limit
    minus its usage where it has a limit below the host's memory, else the host's
    available memory (the smaller of the two)."""
    room = host_available
    files = memory_files(Path(proc_root), Path(cgroup_root))
    if files is not None:
        try:
            limit, usage = read_value(files[0]), read_value(files[1])
        except (OSError, ValueError):
            return room
        if limit is not None and usage is not None and limits(limit, host_total):
            room = min(room, max(0, limit - usage))
    return room


def cgroup_memory_limit(host_total: int, proc_root: str = PROC,
                        cgroup_root: str = CGROUP) -> int | None:
    """This process's memory cgroup's limit where it limits anything (see limits()), else
    None. Raises OSError or ValueError when the limit file cannot be read or parsed."""
    files = memory_files(Path(proc_root), Path(cgroup_root))
    if files is None:
        return None
    limit = read_value(files[0])
    return limit if limit is not None and limits(limit, host_total) else None


def _count(path: Path, key: str) -> int | None:
    """The value of `key` in a "key value" per line file; None if absent or unreadable."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value.strip())
            except ValueError:
                return None
    return None


def oom_kill_files(proc_root: str = PROC, cgroup_root: str = CGROUP) -> list[Path]:
    """Where the OOM kills of this process's memory cgroup are counted, best first: its
    own cgroup's file (v2, then v1), the mount root's (a container's own cgroup)."""
    root, proc = Path(cgroup_root), Path(proc_root)
    v2, v1 = own_cgroups(proc)
    candidates = [root / v2.lstrip("/") / "memory.events", root / "memory.events",
                  root / "memory" / v1.lstrip("/") / "memory.oom_control",
                  root / "memory" / "memory.oom_control"]
    return [p for p in dict.fromkeys(candidates) if _count(p, "oom_kill") is not None]


class OomKills:
    """The kernel's count of OOM kills that would have hit this process's workers: their
    memory cgroup's, else the machine's (/proc/vmstat) where no memory cgroup counts."""

    def __init__(self, proc_root: str = PROC, cgroup_root: str = CGROUP) -> None:
        files = oom_kill_files(proc_root, cgroup_root)
        self.source: Path | None = files[0] if files else Path(proc_root) / "vmstat"
        if _count(self.source, "oom_kill") is None:
            self.source = None  # no count anywhere: an OOM kill cannot be told apart

    def count(self) -> int | None:
        """The count now; None when the kernel does not say. Read at every worker pool's
        start, so with os calls and bytes, not pathlib and text."""
        if self.source is None:
            return None
        try:
            fd = os.open(self.source, os.O_RDONLY | os.O_CLOEXEC)
            try:
                data = os.read(fd, 1 << 16)
            finally:
                os.close(fd)
        except OSError:
            return None
        at = data.find(b"oom_kill ")
        while at > 0 and data[at - 1] != 0x0A:  # a line's start only
            at = data.find(b"oom_kill ", at + 1)
        if at < 0:
            return None
        end = data.find(b"\n", at)
        try:
            return int(data[at + 9:end if end >= 0 else len(data)])
        except ValueError:
            return None


def cgroup_pids_room(proc_root: str = PROC, cgroup_root: str = CGROUP) -> int | None:
    """Processes and threads this process's pids cgroup may still start (pids.max less
    pids.current; v2, then v1), the least over its cgroup and the mount's root (a
    container's own); None where none sets a limit or it cannot be read."""
    root, proc = Path(cgroup_root), Path(proc_root)
    v2, v1 = own_cgroups(proc, "pids")
    rooms = []
    for d in dict.fromkeys((root / v2.lstrip("/"), root, root / "pids" / v1.lstrip("/"),
                            root / "pids")):
        try:
            limit, current = read_value(d / "pids.max"), read_value(d / "pids.current")
        except (OSError, ValueError):
            continue
        if limit is not None and current is not None:
            rooms.append(max(0, limit - current))
    return min(rooms) if rooms else None
