"""Where a worker process's time and memory go, from /proc/<pid> (Linux).

Read by the main process about once a second per live worker (worker_tracker.py), never by the
workers and never on the per-batch path. One sample is a handful of small reads (about
60 µs a worker here); PSS and USS (/proc/<pid>/smaps_rollup) walk the worker's page
tables, about 4 ms for a 200 MB worker and more for bigger ones, so they are read only when
cheap: each read pushes the next one back so that it takes at most PSS_BUDGET of one core.
How fast USS grows (copy-on-read): memgrowth.py.

Time, all cumulative since the process started:
- running: on a CPU, user and system (utime + stime of every thread, /proc/<pid>/stat);
- waiting for a CPU: runnable but in the run queue (the second field of each thread's
  /proc/<pid>/task/<tid>/schedstat), which needs no delay accounting;
- wall: since the process started (its start time in /proc/<pid>/stat).
On a virtual machine, the time the hypervisor took the CPUs from a running worker (steal,
estimated from the machine's: core/facts/cores.py) is moved from blocked to waiting.
What is neither running nor waiting is blocked: storage, the network, a lock, a full
queue, sleep. Nothing here claims I/O that was not seen; bytes read (io) and major page
faults say what blocking may have been. A worker whose threads run at once can run more
than its wall time: blocked is then 0, never negative.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from dataloader_exporter.core.facts.cores import machine_ticks, stolen_ns, stolen_per_run

from .memgrowth import PrivateGrowth

PROC = "/proc"
ROOM_EVERY = 0.9  # seconds between two readings of the memory room
PSS_BUDGET = 0.004  # of one core, for reading PSS (its cost grows with the worker's memory)
STEAL_BUDGET = 0.001  # of one core, for reading /proc/stat (its cost grows with the CPUs)
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class ProcSample:
    """One process's cumulative figures; None where the kernel did not say."""

    start_ticks: int  # start time since boot, in clock ticks: tells a reused pid apart
    wall_ns: int
    running_ns: int
    waiting_ns: int | None
    major_faults: int
    rss_bytes: int
    swap_bytes: int | None
    read_storage: int | None
    read_syscalls: int | None

    @property
    def blocked_ns(self) -> int | None:
        if self.waiting_ns is None:
            return None
        return max(0, self.wall_ns - self.running_ns - self.waiting_ns)


def _gain(new: int | None, was: int | None) -> int | None:
    return None if new is None or was is None else max(0, new - was)


def stat_fields(base: str) -> list[bytes] | None:
    """The fields of <base>/stat after the command name (which may hold spaces and
    parentheses), from the state (field 3) on; None when it cannot be read."""
    stat = _read(f"{base}/stat")
    return None if stat is None else stat.rsplit(b")", 1)[-1].split()


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _field(text: bytes, key: bytes) -> int | None:
    """The value of a "key: value [kB]" line (in bytes where kB), or None: found
    directly, not by parsing every line (a status file has about 55)."""
    head = key + b":"
    if text.startswith(head):
        at = 0
    else:
        at = text.find(b"\n" + head) + 1
        if not at:
            return None
    end = text.find(b"\n", at)
    parts = text[at + len(head):end if end >= 0 else len(text)].split()
    try:
        return int(parts[0]) * (1024 if parts[1:2] == [b"kB"] else 1)
    except (IndexError, ValueError):
        return None


def _waiting_ns(base: str) -> int | None:
    """The run-queue wait of every thread of a process, summed (schedstat's 2nd field)."""
    try:
        tids = os.listdir(f"{base}/task")
    except OSError:
        tids = []
    total, seen = 0, False
    for tid in tids:
        text = _read(f"{base}/task/{tid}/schedstat")
        parts = text.split() if text else []
        if len(parts) >= 2:
            total += int(parts[1])
            seen = True
    return total if seen else None


def sample(pid: int, proc: str = PROC) -> ProcSample | None:
    """The figures of a live process; None when it is gone or /proc cannot be read."""
    base = f"{proc}/{pid}"
    f = stat_fields(base)
    if f is None:
        return None
    try:
        if f[0] in (b"Z", b"X"):
            return None  # a zombie: it has ended
        majflt, utime, stime = int(f[9]), int(f[11]), int(f[12])
        start, rss_pages = int(f[19]), int(f[21])
    except (IndexError, ValueError):
        return None
    now_ns = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    status = _read(f"{base}/status") or b""
    io = _read(f"{base}/io") or b""
    return ProcSample(
        start_ticks=start,
        wall_ns=max(0, now_ns - start * 1_000_000_000 // _TICK),
        running_ns=(utime + stime) * 1_000_000_000 // _TICK,
        waiting_ns=_waiting_ns(base),
        major_faults=majflt,
        rss_bytes=rss_pages * _PAGE,
        swap_bytes=_field(status, b"VmSwap"),
        read_storage=_field(io, b"read_bytes"),
        read_syscalls=_field(io, b"rchar"),
    )


class LoopAccount:
    """The CPU time of the thread that iterates a loader without workers (its fetches and
    its steps alike), from /proc/self/task/<tid>/schedstat: summed over the intervals
    between two readings in which the loader handed out batches with no worker alive.
    cpu_ns is None until one such interval was read."""

    def __init__(self, proc: str = PROC) -> None:
        self.proc = proc
        self.tid = 0  # the thread that last called iter() on the loader (0: none yet)
        self.cpu_ns: int | None = None
        self._last: tuple[int, int] | None = None  # (tid, its running ns) at the last reading

    def observe(self, active: bool) -> None:
        """Reads the thread's running time; active: the interval since the last reading
        counts (batches flowed, made in that thread)."""
        tid = self.tid
        text = _read(f"{self.proc}/self/task/{tid}/schedstat") if tid else None
        parts = text.split() if text else []
        last, self._last = self._last, (tid, int(parts[0])) if parts else None
        if active and last is not None and self._last is not None and last[0] == tid:
            self.cpu_ns = (self.cpu_ns or 0) + max(0, self._last[1] - last[1])


class StealRate:
    """The time a process loses to steal per ns it runs (stolen_per_run), between the
    machine's last two readings of /proc/stat, read only when cheap: each read pushes the
    next one back so that reading takes at most STEAL_BUDGET of one core (about 15 µs a
    read on 2 CPUs; the file grows with the CPUs and interrupts)."""

    def __init__(self, path: str = f"{PROC}/stat", budget: float = STEAL_BUDGET) -> None:
        self.path = path
        self.budget = budget
        self.rate: float | None = None  # the latest known
        self._ticks: tuple[int, int] | None = None
        self._next = 0.0

    def read(self, now: float) -> float | None:
        """The latest rate, the machine read again first if due (`now`, in seconds)."""
        if now >= self._next:
            t0 = time.thread_time()
            ticks = machine_ticks(self.path)
            self._next = now + (time.thread_time() - t0) / self.budget
            rate = stolen_per_run(self._ticks, ticks)
            self._ticks = ticks
            self.rate = self.rate if rate is None else rate
        return self.rate


class PssReader:
    """PSS and USS (private: clean and dirty) of processes, read only when cheap
    (PSS_BUDGET of one core, see above)."""

    def __init__(self, proc: str = PROC, budget: float = PSS_BUDGET) -> None:
        self.proc = proc
        self.budget = budget
        self._next = 0.0
        self.last: dict[int, tuple[int, int | None]] = {}  # pid -> (PSS, USS) at the last read
        self.fresh = False  # whether the last read() read the files (else its figures)
        self.readable = False  # whether a PSS was ever read

    def read(self, pids: list[int], now: float) -> dict[int, tuple[int, int | None]]:
        """(PSS, USS) by pid: read now if due, else the last figures (of pids still
        asked for)."""
        self.fresh = now >= self._next
        if self.fresh:
            t0 = time.thread_time()
            got = {}
            for pid in pids:
                text = _read(f"{self.proc}/{pid}/smaps_rollup") or b""
                pss = _field(text, b"Pss")
                if pss is not None:
                    clean, dirty = _field(text, b"Private_Clean"), _field(text, b"Private_Dirty")
                    got[pid] = (pss, None if clean is None or dirty is None else clean + dirty)
            self.last = got
            self.readable = self.readable or bool(got)
            self._next = now + (time.thread_time() - t0) / self.budget
        return {pid: v for pid, v in self.last.items() if pid in pids}


@dataclass(frozen=True)
class Figures:
    """A loader's workers: counters summed over the intervals in which the loader handed
    out batches (None where a sample lacked the figure), the live workers' memory, and
    the largest resident memory any of its workers has had."""

    running_ns: int | None  # None: no interval seen yet (workers short-lived)
    waiting_ns: int | None
    blocked_ns: int | None
    major_faults: int | None
    read_storage: int | None
    read_syscalls: int | None
    rss_bytes: int | None  # None: no worker read from /proc (figures from their own)
    max_rss_bytes: int | None
    pss_bytes: int | None
    private_grown_bytes: int  # grown since each live worker's first reading (memgrowth.py)
    private_growth: float | None  # bytes per second, the latest measured (memgrowth.py)
    swap_bytes: int | None
    available_bytes: int | None  # the least memory room seen while batches flowed
    stolen_ns: int | None = None  # of waiting_ns, a virtual machine's steal (estimated)
    pss_readable: bool = False  # a worker's PSS was read once: RSS is then not the figure


_SUMMED = ("running_ns", "waiting_ns", "blocked_ns", "major_faults", "read_storage",
           "read_syscalls")


class ProcAccount:
    """The /proc figures of one loader's workers. Time, reads and faults count only the
    intervals between two samples of a worker in which the loader handed out batches:
    persistent workers idle between epochs (or while another loader runs) are not
    "blocked". A worker's start and its last second are not seen. A pool that ends before
    two samples of a worker (an epoch under a second) has its time counted from the
    workers' own figures instead (unsampled)."""

    def __init__(self, proc: str = PROC) -> None:
        self.proc = proc
        self.live: dict[int, ProcSample] = {}
        self._sums: dict[str, int | None] = dict.fromkeys(_SUMMED, 0)
        self._intervals = 0  # intervals counted: none (short-lived workers) is unknown
        self._own = 0  # workers' time counted from their own figures (unsampled)
        self._counted: set[int] = set()  # live workers with an interval counted
        self._peak_rss = 0
        self._room: int | None = None
        self._room_next = 0.0
        self._pss = PssReader(proc)
        self._pss_now: dict[int, tuple[int, int | None]] = {}
        self.growth = PrivateGrowth()
        self._steal_rate = StealRate(f"{proc}/stat")
        self._stolen = 0  # of the waiting sum, the steal estimated

    def observe(self, pids: list[int], now: float, active: bool,
                room: Callable[[], int | None] | None = None) -> None:
        """Samples the live workers `pids`; active: the loader handed out batches since
        the last samples. A worker that cannot be read has ended. room: the memory this
        process's container may still allocate, kept as its low-water mark while active."""
        if active and pids and room is not None and now >= self._room_next:
            self._room_next = now + ROOM_EVERY  # forced readings come sooner: not for this
            now_room = room()
            if now_room is not None:
                self._room = now_room if self._room is None else min(self._room, now_room)
        stolen = self._steal_rate.read(now) if pids else None
        for pid in pids:
            got = sample(pid, self.proc)
            old = self.live.pop(pid, None)
            if got is None:
                continue
            if active and old is not None and old.start_ticks == got.start_ticks:
                self._intervals += 1
                self._counted.add(pid)
                for name in _SUMMED:
                    new, was, total = getattr(got, name), getattr(old, name), self._sums[name]
                    self._sums[name] = (None if new is None or was is None or total is None
                                        else total + max(0, new - was))
                if stolen:
                    self._steal(got.running_ns - old.running_ns,
                                _gain(got.blocked_ns, old.blocked_ns), stolen)
            self.live[pid] = got
            self._peak_rss = max(self._peak_rss, got.rss_bytes)
        self._pss_now = self._pss.read(sorted(self.live), now)
        if self._pss.fresh:
            self.growth.add({pid: uss for pid, (_, uss) in self._pss_now.items()
                             if uss is not None}, now)

    def _steal(self, running: int, blocked: int | None, stolen: float) -> None:
        """Moves the steal estimated for `running` ns from the blocked sum to waiting."""
        wait, block = self._sums["waiting_ns"], self._sums["blocked_ns"]
        if blocked is None or wait is None or block is None:
            return
        moved = stolen_ns(running, blocked, stolen)
        self._sums["waiting_ns"], self._sums["blocked_ns"] = wait + moved, block - moved
        self._stolen += moved

    def end(self, pid: int) -> None:
        """A worker ended."""
        self.live.pop(pid, None)
        self._counted.discard(pid)
        self.growth.end(pid)

    def unsampled(self, own: list[tuple[int, int, int, int]]) -> None:
        """An ended pool's workers that no interval counted: their time from their first
        batch to their last, as each measured it (pid, CPU ns, its thread's run-queue
        wait ns, wall ns; hotpath/workerblock.py): running, waiting (with the latest steal
        estimate), and the rest blocked.
        Reads and faults are not known for it."""
        for pid, cpu, wait, wall in own:
            if pid in self._counted or wall <= 0 or wait < 0 or cpu < 0:
                continue
            self._own += 1
            blocked = max(0, wall - cpu - wait)
            moved = stolen_ns(cpu, blocked, self._steal_rate.rate)
            self._stolen += moved
            for name, v in (("running_ns", cpu), ("waiting_ns", wait + moved),
                            ("blocked_ns", blocked - moved)):
                total = self._sums[name]
                self._sums[name] = None if total is None else total + v

    def figures(self) -> Figures | None:
        """None until a worker has been read (no workers, or no /proc: unknown)."""
        if not self.live and not self._peak_rss and not self._own:
            return None
        live = list(self.live.values())
        swaps = [s.swap_bytes for s in live]
        pss = [self._pss_now.get(pid, (None, None))[0] for pid in self.live]
        sums = dict(self._sums) if self._intervals or self._own else dict.fromkeys(_SUMMED)
        if not self._intervals:  # the workers' own figures hold no reads or faults
            sums.update(dict.fromkeys(_SUMMED[3:]))
        seen = bool(self.live or self._peak_rss)
        return Figures(
            running_ns=sums["running_ns"], waiting_ns=sums["waiting_ns"],
            blocked_ns=sums["blocked_ns"], major_faults=sums["major_faults"],
            stolen_ns=None if sums["waiting_ns"] is None else self._stolen,
            read_storage=sums["read_storage"], read_syscalls=sums["read_syscalls"],
            available_bytes=self._room,
            rss_bytes=sum(s.rss_bytes for s in live) if seen else None,
            max_rss_bytes=self._peak_rss if seen else None,
            pss_bytes=None if None in pss else sum(p for p in pss if p is not None),
            private_growth=self.growth.rate, private_grown_bytes=self.growth.grown(),
            pss_readable=self._pss.readable,
            swap_bytes=None if None in swaps else sum(s for s in swaps if s is not None))
