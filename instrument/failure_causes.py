"""Why a worker failed, as observed; never a cause that was not seen.

A worker that dies leaves an exit status (read without reaping it, or from torch's own
Process object once torch reaped it) and sometimes torch's words in the exception the
loop gets; a worker that fails without dying leaves only the exception. The causes
(core.catalogue.FAILURE_CAUSES):

- oom: killed by SIGKILL after the kernel's OOM-kill count of our memory cgroup rose
  since the worker was last seen alive (core.facts.cgroup); a rise is claimed once in
  the process; never claimed without that count, and a count not read lately gives no
  cause at all rather than a guess either way;
- killed: killed by SIGKILL while that count did not rise, or by another signal that
  ends a process;
- crash: a crash signal (SIGSEGV, SIGABRT, ...), a non-zero exit, or an exit torch calls
  unexpected;
- shm: /dev/shm was full: torch could not allocate or write a batch's shared memory (its
  own words, in a worker), or the worker died of SIGBUS while /dev/shm was small or half
  full;
- error: the dataset or collate_fn raised: torch's "Caught X in DataLoader worker
  process N", or any exception with no workers. torch's own errors (a timeout, its
  internals after a worker vanished) are not the dataset's: no cause.

Each cause gets one log line per loader with what to change (fix()). Whether a worker is
still alive at all is Liveness's to say.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dataloader_exporter.core.bands import SHM_SAFETY, shm_size_advice
from dataloader_exporter.core.facts.cgroup import OomKills
from dataloader_exporter.core.facts.shm import SHM_PATH, ShmSpace, shm_space

from .preflight import LoaderConfig, shm_needed
from .procstat import PROC, stat_fields
from .rank import human_bytes

if TYPE_CHECKING:
    from .cowscan import Container

OOM, KILLED, CRASH, SHM, ERROR = "oom", "killed", "crash", "shm", "error"
ALIVE, DYING, GONE = "alive", "dying", "gone"  # Liveness.state
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGILL, signal.SIGFPE,
                  signal.SIGTRAP, signal.SIGSYS}
_DEATH = re.compile(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]{1,200})\) "
                    r"(?:is killed by signal: ([A-Za-z ]{1,40})|exited unexpectedly)")
_SIGNAL_NAMES = {signal.strsignal(s): s for s in signal.Signals
                 if signal.strsignal(s) is not None}
# torch's words for a batch that did not fit in /dev/shm: an allocation or a write of its
# shared-memory file (torch_shm_manager's files are named /torch_...).
_SHM_WORDS = ("unable to allocate shared memory(shm) for file </torch_",
              "unable to write to file </torch_")
_CAUGHT = "in DataLoader worker process"  # torch's wrapper of a worker's exception
GREW = 16 << 20  # private memory grown by this much is worth saying (a batch is not)
_PF_EXITING = 0x4  # a task's flag (/proc/<pid>/stat field 9) once it has begun to exit
SHM_SMALL = 1 << 30  # a /dev/shm under 1 GiB (a container's) is small enough to fill


def shm_full(path: str = SHM_PATH) -> bool:
    """Whether /dev/shm could have been what a SIGBUS hit: small (a container's) or at
    least half full."""
    space = shm_space(path)
    return space is not None and (space.size < SHM_SMALL or space.used * 2 >= space.size)


def signal_name(signo: int) -> str:
    try:
        return signal.Signals(signo).name
    except ValueError:
        return str(signo)


Exit = tuple[int | None, int | None]  # (the signal that ended it, or its exit code)


def exit_of(pid: int) -> Exit | None:
    """How a dead process ended, without reaping it; None when unknown or still running."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (ChildProcessError, OSError):
        info = None
    else:
        if info is None or info.si_pid == 0:
            return None  # still running
        if info.si_code == os.CLD_EXITED:
            return None, info.si_status
        return info.si_status, None
    try:  # not our child (forkserver): a zombie still shows its exit code (Linux >= 3.5)
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    if len(fields) < 50 or fields[0] != b"Z":
        return None
    status = int(fields[49])
    if os.WIFSIGNALED(status):
        return os.WTERMSIG(status), None
    return None, os.WEXITSTATUS(status)


def from_exitcode(code: int | None) -> Exit | None:
    """multiprocessing's Process.exitcode (-signal, or the code) as an Exit."""
    if code is None:
        return None
    return (-code, None) if code < 0 else (None, code)


def cause_of_exit(signo: int | None, code: int | None, oom_rose: bool | None,
                  shm_full: bool = False) -> str | None:
    """The cause of a worker's death from its exit; None for a clean exit (0), or for a
    SIGKILL when the OOM-kill count is not known (oom_rose None)."""
    if signo is None:
        return CRASH if code else None
    if signo == signal.SIGKILL:
        return None if oom_rose is None else OOM if oom_rose else KILLED
    if signo == signal.SIGBUS:
        return SHM if shm_full else CRASH  # a mapped file cut short also raises SIGBUS
    if signo in _CRASH_SIGNALS:
        return CRASH
    return KILLED


def deaths_in(exc: BaseException) -> tuple[list[int], int | None] | None:
    """(pids, signal) torch names in a worker's death (signal None: "exited
    unexpectedly"); None if the exception is not about a dead worker."""
    m = _DEATH.search(str(exc)[:2000])
    if m is None:
        return None
    pids = [int(p) for p in m.group(1).replace(",", " ").split()]
    return pids, _SIGNAL_NAMES.get(m.group(2).strip()) if m.group(2) else None


def cause_of_error(exc: BaseException, workers: int) -> str | None:
    """The cause of an exception that reached the loop and is not a worker's death: shm
    or error; None for torch's own (a timeout, its internals)."""
    text = str(exc)
    if workers and any(words in text for words in _SHM_WORDS):
        return SHM
    if not workers or _CAUGHT in text.split("\n", 1)[0]:
        return ERROR
    return None


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The exception as one short line: its type and the first line of its message (for
    torch's wrapper, the worker's own exception after its traceback)."""
    text = str(exc)
    if "Original Traceback" in text:
        lines = text.splitlines()
        frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
        after = lines[frames[-1] + 2:] if frames else lines[-1:]
        line = next((x.strip() for x in after if x.strip()), type(exc).__name__)
    else:
        first = next((x for x in text.splitlines() if x.strip()), "")
        line = f"{type(exc).__name__}: {first.strip()}".rstrip(": ")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def is_torch_worker_error(e: BaseException) -> bool:
    """torch's SIGCHLD handler raises a dead worker's error wherever the main thread is;
    one that lands in our bookkeeping must go on to the loop, as it would without us."""
    return isinstance(e, RuntimeError) and str(e).startswith("DataLoader worker")


class OomWatch:
    """The kernel's OOM-kill count, read by every tracker of the process (at each of its
    readings, about once a second); each rise is claimed by at most one worker that died
    of SIGKILL, and only by one last seen alive before the rise."""

    STALE = 10.0  # seconds: a worker last seen longer ago gets no cause from the count

    def __init__(self, kills: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._kills = kills if kills is not None else OomKills()
        self._clock = clock
        self._claimed = 0  # the count up to which rises are claimed
        self._lock = threading.Lock()
        self._last: tuple[float, int] | None = None  # the latest reading

    def read(self, max_age: float = 0.0) -> tuple[float, int] | None:
        """(when, the count); None when the kernel gives no count. max_age: the latest
        reading, by any tracker of the process, where it is at most that many seconds old
        (a reading is a file's open and read: a pool started every few milliseconds
        reads once per tracker interval, the precision a live worker's reading has)."""
        last = self._last
        if max_age > 0 and last is not None and self._clock() - last[0] <= max_age:
            return last
        count = self._kills.count()
        now = self._last = None if count is None else (self._clock(), count)
        return now

    def claim(self, seen: tuple[float, int] | None) -> bool | None:
        """Whether a SIGKILL of a worker last seen alive at reading `seen` was the OOM
        killer's: the count rose since, by a rise no other death claimed. None when it
        cannot be told (no count, no reading, or one too old)."""
        now = self.read()
        if now is None or seen is None or now[0] - seen[0] > self.STALE:
            return None
        with self._lock:
            claimed = max(seen[1], self._claimed)
            if now[1] > claimed:
                self._claimed = claimed + 1
                return True
            return False


_watch: OomWatch | None = None
_watch_lock = threading.Lock()


def oom_watch() -> OomWatch:
    """The process's one OomWatch (every loader's workers share its cgroup)."""
    global _watch
    with _watch_lock:
        if _watch is None:
            _watch = OomWatch()
        return _watch


def copy_on_read(c: Container) -> str:
    """What a container of Python objects costs each worker, and what to hold it in."""
    from dataloader_exporter.core.copyonread import remedy  # for an OOM kill only

    return (f"copy-on-read: {c.attribute} is a {c.container} of {c.objects:,} {c.item} (about "
            f"{human_bytes(c.bytes)}) whose items' reference counts each worker writes as it "
            "reads them, copying their pages into its own memory; store it as "
            f"{remedy(c.attribute, c.container, c.item)}")


def fix(cause: str, seen: str, cfg: LoaderConfig, batch_bytes: int, local_ranks: int,
        shm: ShmSpace | None, rss_per_worker: int | None,
        grown: tuple[int, int] | None = None, held: tuple[Container, ...] = ()) -> str:
    """What was seen and what to change, in one line (after "dataloader 'x': "). grown:
    the failed worker's first and last private memory read; held: the dataset's largest
    container of Python objects (cowscan.py)."""
    workers = cfg.num_workers or 0
    if cause == SHM:
        if batch_bytes > 0 and workers:
            need = shm_needed(batch_bytes, cfg, local_ranks)
            what = (f"batches in flight need about {human_bytes(need)} (batch "
                    f"{human_bytes(batch_bytes)} x prefetch_factor {cfg.prefetch_factor or 2}"
                    f" x {workers} workers x {local_ranks} local ranks x {SHM_SAFETY})")
            size = shm_size_advice(need)
        else:  # no batch got through: its size is unknown; at least twice the room
            what = "the batches in flight did not fit (their size is not known yet)"
            size = shm_size_advice(2 * shm.size) if shm else "a larger size"
        where = f"{shm.path} holds {human_bytes(shm.size)}" if shm else "/dev/shm"
        return (f"a worker failed for lack of shared memory ({seen}): {where} and {what}. "
                f"Give the container --shm-size={size} (Kubernetes: an emptyDir with medium: "
                "Memory and a sizeLimit at /dev/shm), or lower num_workers or prefetch_factor")
    if cause == OOM:
        each = (f"; each worker holds about {human_bytes(rss_per_worker)} resident"
                if rss_per_worker else "")
        if grown is not None and grown[1] - grown[0] >= GREW:
            each += (f"; its private memory had grown from {human_bytes(grown[0])} to "
                     f"{human_bytes(grown[1])}")
            if held:
                return (f"a worker was killed by the kernel's OOM killer ({seen}){each}. "
                        f"{copy_on_read(held[0])}; or use fewer workers (num_workers="
                        f"{workers} now), or raise the container's memory limit")
        return (f"a worker was killed by the kernel's OOM killer ({seen}){each}. Use fewer "
                f"workers (num_workers={workers} now) or a lower prefetch_factor, or raise "
                "the container's memory limit")
    if cause == KILLED:
        return (f"a worker was killed ({seen}), not by the OOM killer (the kernel's OOM-kill "
                "count did not rise): something else ended it (a scheduler, a watchdog, a "
                "person)")
    if cause == CRASH:
        return (f"a worker crashed ({seen}): native code in the dataset or a library it "
                "calls (decoding, augmentation) failed; run with num_workers=0 to see where")
    return f"the dataset or collate_fn raised {seen}"


class Liveness:
    """Whether processes first seen alive are still running: the same process (its start
    time in /proc/<pid>/stat, so a reused pid is not it) and not a zombie, as
    psutil.Process(pid).is_running() and status() tell it; psutil (imported only here,
    and only where there is no /proc) elsewhere."""

    def __init__(self, proc: str = PROC) -> None:
        self._proc = proc
        self._starts: dict[int, bytes] = {}
        self._psutil: dict[int, Any] | None = None if os.path.isdir(f"{proc}/self") else {}

    def _state(self, pid: int) -> tuple[bytes, bytes, bool] | None:
        """(state, start time, dying) from /proc/<pid>/stat; dying: exiting (PF_EXITING in
        its flags) or killed, SIGKILL pending (the kernel queues a fatal signal on each of
        its threads: stat's "signal" field holds it)."""
        f = stat_fields(f"{self._proc}/{pid}")
        if f is None or len(f) <= 19:
            return None
        try:
            dying = bool(int(f[6]) & _PF_EXITING) or (
                len(f) > 28 and bool(int(f[28]) & 1 << (signal.SIGKILL - 1)))
        except ValueError:
            dying = False
        return f[0], f[19], dying

    def state(self, pid: int) -> str:
        """ALIVE, DYING (on its way out: exiting, or SIGKILL pending; a worker the OOM
        killer just picked is not alive, so that the kill count read beside it is not taken
        as seen before the kill, nor has it ended yet) or GONE."""
        if self._psutil is not None:
            return ALIVE if self._alive_psutil(pid) else GONE
        now = self._state(pid)
        if now is None or now[0] in (b"Z", b"X", b"x"):
            return GONE
        if self._starts.setdefault(pid, now[1]) != now[1]:
            return GONE  # its pid taken by another process
        return DYING if now[2] else ALIVE

    def alive(self, pid: int) -> bool:
        return self.state(pid) == ALIVE

    def _alive_psutil(self, pid: int) -> bool:
        import psutil

        assert self._psutil is not None
        try:
            proc = self._psutil.get(pid) or self._psutil.setdefault(pid, psutil.Process(pid))
            return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
        except psutil.Error:
            return False

    def forget(self, pid: int) -> None:
        self._starts.pop(pid, None)
        if self._psutil is not None:
            self._psutil.pop(pid, None)
