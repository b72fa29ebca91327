"""Why workers failed, as the trainer observed it (catalogue.FAILURE_CAUSES: a cause is
counted only when it was seen), with the fix for each; and what is known of the cause of
a lost worker (dataloader_workers_lost_total counts deaths, not causes). An OOM kill names
the workers' private memory growth and the dataset's container that held it, where known
(NOTE [ copy-on-read ] in diagnosis.memgrowth)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.diagnosis import memgrowth
from dataloader_exporter.diagnosis.signals import LoaderSignals
from dataloader_exporter.diagnosis.units import GiB, gib
from dataloader_exporter.diagnosis.why import WorkerView, memory_kind

DEATHS = ("oom", "killed", "crash", "shm")  # causes a worker may die of (error: it raised)


@dataclass(frozen=True)
class Shm:
    """/dev/shm as the doctor knows it: its size and what the batches in flight need
    (doctor.shm_in_flight), each None when unknown, and the --shm-size for that need."""

    size: float | None
    in_flight: float | None
    advice: str | None


def entries(s: LoaderSignals, v: WorkerView, shm: Shm, workers: int | None
            ) -> list[dict[str, object]]:
    """A loader's `failures`: one entry per cause seen (count > 0): what was seen, the fix,
    and the figures behind them."""
    out: list[dict[str, object]] = []
    for cause in cat.FAILURE_CAUSES:
        count = (s.failures or {}).get(cause, 0.0)
        if count > 0:
            entry: dict[str, object] = {"cause": cause, "count": count}
            entry.update(_EXPLAIN[cause](s, v, shm, workers, count))
            out.append(entry)
    return out


def _times(n: float, what: str) -> str:
    return f"{n:.0f} {what}{'' if n == 1 else 's'}"


def _shm(s: LoaderSignals, v: WorkerView, shm: Shm, workers: int | None,
         n: float) -> dict[str, object]:
    out: dict[str, object] = {"shm_size_bytes": shm.size, "in_flight_bytes": shm.in_flight}
    size = shm.advice
    if shm.in_flight is not None and shm.size is not None:
        where = (f"the batches in flight need about {gib(shm.in_flight)} against a /dev/shm "
                 f"of {gib(shm.size)}")
        if shm.in_flight <= shm.size:  # it fits by our estimate: batches vary, or others
            size = f"{max(1, math.ceil(2 * shm.size / GiB))}g"
            where += (", which holds them by our estimate: batches vary in size or other "
                      "processes fill /dev/shm (see shm_used_bytes)")
    elif shm.size is not None:
        where = (f"/dev/shm holds {gib(shm.size)}; what the batches in flight need is unknown "
                 "(no dataloader_batch_bytes)")
    else:
        where = "/dev/shm's size is unknown"
    out["shm_size"] = size
    out["seen"] = (f"shm: {_times(n, 'failure')} for lack of shared memory (/dev/shm full): "
                   f"{where}")
    give = (f"give the container --shm-size={size} (Kubernetes: an emptyDir with medium: "
            f"Memory and sizeLimit: {size[:-1]}Gi at /dev/shm)" if size else
            "give the container a larger --shm-size (Kubernetes: a memory-backed emptyDir "
            "with a larger sizeLimit at /dev/shm)")
    out["fix"] = f"{give}, or lower num_workers or prefetch_factor"
    return out


def _oom(s: LoaderSignals, v: WorkerView, shm: Shm, workers: int | None,
         n: float) -> dict[str, object]:
    each = (f"; each worker holds {gib(v.rss_bytes)} ({memory_kind(v)})"
            if v.rss_bytes
            else "; the memory per worker is unknown")
    largest = f", the largest {gib(v.max_rss_bytes)} resident" if v.max_rss_bytes else ""
    now = f" (num_workers={workers} now)" if workers is not None else ""
    limit = f" ({gib(s.cgroup_limit)} now)" if s.cgroup_limit else ""
    grew, first = memgrowth.oom_words(s)
    share = ("" if s.dataset_containers else "; datasets that share memory across workers "
             "(numpy arrays or tensors, not lists of Python objects)")
    return {"worker_memory_bytes": v.rss_bytes, "memory_kind": v.memory_kind,
            "max_worker_rss_bytes": v.max_rss_bytes, "memory_limit_bytes": s.cgroup_limit,
            "worker_private_growth_bytes_per_second": s.workers.private_growth,
            "dataset_containers": [asdict(c) for c in s.dataset_containers],
            "seen": (f"oom: {_times(n, 'worker')} killed by the kernel's OOM killer (its "
                     f"OOM-kill count rose){each}{largest}{grew}"),
            "fix": (f"{first}fewer workers{now} or a lower prefetch_factor, or a higher memory "
                    f"limit{limit}{share}")}


def _killed(s: LoaderSignals, v: WorkerView, shm: Shm, workers: int | None,
            n: float) -> dict[str, object]:
    return {"seen": (f"killed: {_times(n, 'worker')} killed by a signal, not by the OOM "
                     "killer (the kernel's OOM-kill count did not rise): another process, a "
                     "scheduler, a watchdog or a person ended it"),
            "fix": "find what sends the signal (the scheduler's events, the host's log)"}


def _crash(s: LoaderSignals, v: WorkerView, shm: Shm, workers: int | None,
           n: float) -> dict[str, object]:
    return {"seen": (f"crash: {_times(n, 'worker')} crashed (SIGSEGV, SIGABRT or an abnormal "
                     "exit): a crash in native code, usually a decoding library (images, "
                     "video, audio, parquet)"),
            "fix": ("run with num_workers=0 to see the traceback in the main process; find "
                    "the sample that triggers it, or pin or upgrade the library")}


def _error(s: LoaderSignals, v: WorkerView, shm: Shm, workers: int | None,
           n: float) -> dict[str, object]:
    return {"seen": (f"error: the dataset or collate_fn raised {_times(n, 'time')} (the "
                     "loop got the exception, with the worker's traceback)"),
            "fix": ("fix the dataset; with num_workers=0 it runs in the main process, under "
                    "a debugger")}


_EXPLAIN = {"shm": _shm, "oom": _oom, "killed": _killed, "crash": _crash, "error": _error}


def lost_message(s: LoaderSignals) -> str:
    """The lost-workers finding: the causes seen, or that the cause is not known and
    what would tell."""
    alive = ("" if s.workers_active is None or s.workers_configured is None else
             f"; {s.workers_active:.0f} of {s.workers_configured:.0f} alive now")
    lost = f"lost workers: {s.workers_lost:.0f} died while the loader needed them{alive}"
    if s.failures is None:
        return (f"{lost}; the cause is not known: this trainer exports no causes "
                f"({cat.FAILURES.name}, from a dataloader-exporter that records oom, killed, "
                "crash and shm would tell); meanwhile check dmesg for the OOM killer and "
                "/dev/shm's size")
    seen = [f"{c} {s.failures[c]:.0f}" for c in DEATHS if s.failures.get(c, 0.0) > 0]
    if seen:
        return f"{lost}; causes: {', '.join(seen)} (see their findings)"
    return (f"{lost}; no cause was observed (no OOM-kill count rise, kill or crash signal or "
            "/dev/shm error was seen): check dmesg and the trainer's log")
