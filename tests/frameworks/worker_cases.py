"""Workers that are slow for a known reason, or fail for one. argv: CASE OUT.

Slow (one run, three loaders, each iterated about SECONDS): workers that spin on the CPU
(cpu), four workers pinned to one core (cpu_contention), workers that sleep as on network
storage (blocked). Failing (one loader each; the bare torch DataLoader first, then the
instrumented one, side by side): a dataset that raises (error), a worker that segfaults
(crash), a worker killed by SIGKILL from outside (killed), batches too big for /dev/shm
(shm: run it with a small private /dev/shm), a worker that allocates past its memory
cgroup's limit (oom: run it in one). Each records what the loop saw, for the test.
"""

import os
import signal
import sys
import time
from typing import Any

import torch
from common import record
from torch.utils.data import DataLoader, Dataset

from dataloader_exporter import instrument

SECONDS = 3.0


class Work(Dataset):  # type: ignore[type-arg]
    """Samples that cost `cpu` seconds of CPU or `sleep` seconds of waiting, or fail at
    index `bad` in the way `fail` names."""

    def __init__(self, n: int, cpu: float = 0.0, sleep: float = 0.0, fail: str = "",
                 bad: int = -1, size: int = 4) -> None:
        self.n, self.cpu, self.sleep, self.fail, self.bad, self.size = (
            n, cpu, sleep, fail, bad, size)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad:
            if self.fail == "error":
                raise ValueError(f"corrupt sample {i}")
            if self.fail in ("crash", "oom"):
                # After a pause: the loop has taken this worker's earlier samples, whose
                # descriptors torch fetches from the worker (a death before that is a
                # ConnectionResetError or EOFError in the loop, bare torch or not: a race
                # of torch's, not the case under test).
                time.sleep(1.0)
            if self.fail == "crash":
                os.kill(os.getpid(), signal.SIGSEGV)
            if self.fail == "oom":
                hog = bytearray(8 << 30)  # zero-filled: every page is touched
                return torch.tensor([len(hog)])
            if self.fail == "wait":
                time.sleep(60)  # until the test's SIGKILL
        end = time.process_time() + self.cpu
        while time.process_time() < end:
            pass
        if self.sleep:
            time.sleep(self.sleep)
        return torch.zeros(self.size)


def pin_to_one_core(worker_id: int) -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def run_for(loader: Any, seconds: float) -> int:
    batches, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in loader:
            batches += 1
            if time.monotonic() >= end:
                break
    return batches


def slow(out: str) -> None:
    kw = {"batch_size": 1, "persistent_workers": True}
    loaders = {
        "cpu": instrument.DataLoader(Work(10**6, cpu=0.01), num_workers=1, name="cpu", **kw),
        "cpu_contention": instrument.DataLoader(Work(10**6, cpu=0.01), num_workers=4,
                                                worker_init_fn=pin_to_one_core,
                                                name="cpu_contention", **kw),
        "blocked": instrument.DataLoader(Work(10**6, sleep=0.02), num_workers=2,
                                         name="blocked", **kw),
    }
    record(out, 0, batches={name: run_for(loader, SECONDS) for name, loader in loaders.items()})


def seen(exc: BaseException) -> str:
    """The exception as the loop sees it: its type and first line, with pids and worker
    numbers (which worker fails first is a race) left out."""
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: " + " ".join(
        "N" if w.strip("(),.").isdigit() else w for w in line.split())


def failing(case: str, out: str) -> None:
    size = 2 * 1024 * 1024 if case == "shm" else 4  # 8 MiB float32 samples
    kw: dict[str, Any] = {"batch_size": 1 if case != "shm" else 2, "num_workers": 2}
    got = {}
    before = shm_used()
    for which in ("bare", "ours"):
        ds = Work(64, fail=case if case != "killed" else "wait", bad=5, size=size,
                  sleep=0.01)
        loader = (DataLoader(ds, **kw) if which == "bare" else
                  instrument.DataLoader(ds, name=case, **kw))
        batches = 0
        try:
            it = iter(loader)
            for _ in it:
                batches += 1
                # Sample 3 taken: its worker has handed it over whole and waits on sample 5
                # (killed during a hand-over, torch can fail otherwise, differently).
                if case == "killed" and batches == 4:
                    os.kill(it._workers[5 % 2].pid, signal.SIGKILL)
        except Exception as e:
            got[which] = seen(e)
        else:
            got[which] = "no exception"
        if case == "shm":  # the next run starts where this one did: /dev/shm given back
            del it, loader
            settle(before)
    record(out, 0, seen=got)


def shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def settle(before: int, seconds: float = 10.0) -> None:
    """Waits until the shared memory a finished loader held is freed (its workers'
    batches in /dev/shm go with torch's iterator), so the bare and the instrumented run
    each start with /dev/shm as it was."""
    import gc

    end = time.monotonic() + seconds
    while True:
        gc.collect()
        if shm_used() <= before + (1 << 20) or time.monotonic() > end:
            return
        time.sleep(0.1)


if __name__ == "__main__":
    case, out = sys.argv[1], sys.argv[2]
    if case == "slow":
        slow(out)
    else:
        failing(case, out)
