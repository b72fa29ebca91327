"""What the loader tuner's rules (core/tuner/rules.py) take and give: a setting, the
budget a rank may use, what a window measured, and a decision. Pure data."""

from __future__ import annotations

from dataclasses import dataclass

from dataloader_exporter.core.tuner.model import Load


@dataclass(frozen=True)
class Setting:
    workers: int
    prefetch: int  # torch's prefetch_factor; ignored (2) without workers


@dataclass(frozen=True)
class Budget:
    """What this rank may use: cores for its workers (the advisor's share per local
    rank, less one for a loop on the CPU), the room left in memory and /dev/shm, the
    cores as CPU time for the model (its share of the machine's; the loop's own use is
    measured) and how many more workers than now the process and open-file limits
    allow (None: unknown)."""

    cores: int
    memory_room: int | None = None
    shm_room: int | None = None
    cpus: float | None = None
    limit: int | None = None


@dataclass(frozen=True)
class Epoch:
    """What one epoch under `setting` measured; None where it was not measured."""

    setting: Setting
    samples_per_s: float
    stall: float  # share of the loop's time waiting for input
    running: float | None = None  # shares of the workers' wall time
    waiting_cpu: float | None = None
    blocked: float | None = None
    # Memory one worker takes (PSS, else RSS); with no workers yet, the main process's
    # resident memory, which bounds what a forked worker can take. Projected: it includes
    # worker_to_come.
    worker_bytes: int | None = None
    batch_bytes: int | None = None
    burstiness: float | None = None  # fetch wait p95 / median
    unit: str = "samples"  # what samples_per_s counts: "batches" where samples cannot be
    load: Load | None = None  # per-batch figures for the model (core/tuner/model.py)
    # Memory each worker will still take: the part of the dataset's containers of Python
    # objects it has not copied yet (copy-on-read), counted before it is paid; and what
    # holds them (dataset.paths), for the log.
    worker_to_come: int = 0
    copied: str = ""
    # The wait for the epoch's first batch where its iter() started a new pool (seconds,
    # and its share of the epoch's wall time); None where the pool was reused or none ran.
    start_s: float | None = None
    start_share: float | None = None


@dataclass(frozen=True)
class Decision:
    setting: Setting
    name: str  # "num_workers" or "prefetch_factor"
    old: int
    new: int
    reason: str  # one of REASONS
    why: str  # the figures, for the log line

    def line(self, loader: str) -> str:
        """The log line: `dataloader 'train': num_workers 2 -> 4: <why>`."""
        return f"dataloader {loader!r}: {self.name} {self.old} -> {self.new}: {self.why}"
