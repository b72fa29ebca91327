"""Why a worker failed, as observed; never a cause that was not seen.

A worker that dies leaves an exit status (read without reaping it, or from torch's own
Process object once torch reaped it) and sometimes torch's words in the exception the
loop gets; a worker that fails without dying leaves only the exception. The causes
(exporter.catalogue.FAILURE_CAUSES):

- oom: killed by SIGKILL while the kernel's OOM-kill count of our memory cgroup rose
  (exporter.facts.cgroup); never claimed without that count;
- killed: killed by SIGKILL without it, or by another signal that ends a process;
- crash: a crash signal (SIGSEGV, SIGABRT, ...) or a non-zero exit;
- shm: /dev/shm was full: torch could not allocate a batch's shared memory (an error in
  the worker), or the worker died of SIGBUS touching it;
- error: the dataset or collate_fn raised (in a worker, or in the main process).

Each cause gets one log line per loader with what to change (fix()).
"""

from __future__ import annotations

import re
import signal
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from diagnosis.doctor import SHM_SAFETY, shm_size_advice
from exporter.facts.cgroup import OomKills
from exporter.facts.shm import ShmSpace

from .env import human_bytes
from .preflight import LoaderConfig, shm_needed

OOM, KILLED, CRASH, SHM, ERROR = "oom", "killed", "crash", "shm", "error"
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGILL, signal.SIGFPE,
                  signal.SIGTRAP, signal.SIGSYS}
_DEATH = re.compile(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) "
                    r"(?:is killed by signal: ([^.]+)|exited unexpectedly)")
_SIGNAL_NAMES = {signal.strsignal(s): s for s in signal.Signals
                 if signal.strsignal(s) is not None}
# torch's words for a batch that did not fit in /dev/shm (an allocation or a write).
_SHM = re.compile(r"unable to (?:allocate shared memory|write to file </torch_)"
                  r"|No space left on device.*(?:shm|/torch_)|(?:shm|/torch_).*No space left",
                  re.IGNORECASE)


def cause_of_exit(signo: int | None, code: int | None, oom_rose: bool) -> str | None:
    """The cause of a worker's death from its exit; None for a clean exit (0)."""
    if signo is None:
        return CRASH if code else None
    if signo == signal.SIGKILL:
        return OOM if oom_rose else KILLED
    if signo == signal.SIGBUS:
        return SHM
    if signo in _CRASH_SIGNALS:
        return CRASH
    return KILLED


def deaths_in(exc: BaseException) -> tuple[list[int], int | None] | None:
    """(pids, signal) torch names in a worker's death (signal None: "exited
    unexpectedly"); None if the exception is not about a dead worker."""
    m = _DEATH.search(str(exc))
    if m is None:
        return None
    pids = [int(p) for p in m.group(1).replace(",", " ").split()]
    return pids, _SIGNAL_NAMES.get(m.group(2).strip()) if m.group(2) else None


def cause_of_error(exc: BaseException) -> str:
    """The cause of an exception that reached the loop and is not a worker's death."""
    return SHM if _SHM.search(str(exc)) else ERROR


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The exception as one short line: its type and the first line of its message."""
    text = [line for line in str(exc).strip().splitlines() if line.strip()]
    if "Original Traceback" in str(exc) and text:  # torch's wrapper: the worker's own line
        line = text[-1].strip()
    else:
        line = f"{type(exc).__name__}: {text[0] if text else ''}".strip()
    return line if len(line) <= limit else line[: limit - 3] + "..."


class OomWatch:
    """Rises of the kernel's OOM-kill count (exporter.facts.cgroup.OomKills), each
    claimed by at most one worker that died of SIGKILL within WINDOW seconds of it. A
    reading is taken at least once a second by the tracker; a rise older than WINDOW (an
    OOM kill of some other process of the cgroup) is never claimed."""

    WINDOW = 10.0

    def __init__(self, kills: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._kills = kills if kills is not None else OomKills()
        self._clock = clock
        self._readings: deque[tuple[float, int]] = deque()
        self._claimed = 0  # rises since the oldest reading already claimed

    def read(self) -> int | None:
        """Takes a reading; None when the kernel gives no count."""
        count = self._kills.count()
        if count is None:
            return None
        now = self._clock()
        self._readings.append((now, count))
        while len(self._readings) > 1 and self._readings[1][0] <= now - self.WINDOW:
            old = self._readings.popleft()[1]
            self._claimed = max(0, self._claimed - (self._readings[0][1] - old))
        return count

    def claim(self) -> bool:
        """Whether a SIGKILL just seen was the OOM killer's: the count rose, unclaimed."""
        count = self.read()
        if count is None or len(self._readings) < 2:
            return False  # no count, or no reading from before the death to compare with
        if count - self._readings[0][1] - self._claimed > 0:
            self._claimed += 1
            return True
        return False


def fix(cause: str, seen: str, cfg: LoaderConfig, batch_bytes: int, local_ranks: int,
        shm: ShmSpace | None, rss_per_worker: int | None) -> str:
    """What was seen and what to change, in one line (after "dataloader 'x': ")."""
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
