"""Real trainer snapshot files, as instrument's own SnapshotWriter wrote them, committed
under tests/trainer_snapshots/ so that the sidecar's tests need no torch.

Each case below is one trainer process: its rank, its loaders (name, num_workers; 0
workers gives a file without per-worker series), the batches each ran, the loader whose
to_device() ran before it was ever iterated (its recorder then exists without a
configuration, as in a real program), and whether it exited normally (its exit hook ran;
otherwise a snapshot written while it runs, or the last before a kill).

tests/test_real_snapshots.py (with torch) checks that the writer still writes files of
the committed shape. After a change to what the trainer writes, rewrite them:

    .venv/bin/python tests/support/real_snapshots.py
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

# (loader name, num_workers)
Loaders = Sequence[tuple[str, int]]
Case = tuple[str, tuple[tuple[str, int], ...], int, str | None, bool]

DIRECTORY = Path(__file__).resolve().parents[1] / "trainer_snapshots"
# (rank, loaders, batches, to_device_first, exited): the cases the tests read.
CASES: tuple[Case, ...] = (
    ("0", (("t", 2),), 4, None, False),
    ("0", (("t", 2),), 4, None, True),
    ("0", (("t", 0),), 4, None, False),
    ("1", (("t", 2), ("v", 0)), 4, None, False),
    ("2", (("a", 0), ("b", 1)), 4, "b", False),
    ("3", (), 4, None, False),
)


def file_name(case: Case) -> str:
    rank, loaders, batches, first, exited = case
    parts = [f"rank{rank}", *(f"{name}{workers}" for name, workers in loaders)]
    parts.append(f"{batches}batches")
    parts += ([f"first-{first}"] if first else []) + (["exited"] if exited else [])
    return "-".join(parts) + ".prom"


def real_snapshot(rank: str = "0", loaders: Loaders = (("t", 2),), batches: int = 4,
                  to_device_first: str | None = None, exited: bool = False) -> bytes:
    """What a trainer process of `rank` running `loaders` writes to its snapshot file
    (the committed copy: a case of CASES)."""
    case: Case = (rank, tuple(loaders), batches, to_device_first, exited)
    if case not in CASES:
        raise LookupError(f"no committed snapshot for {case}: add it to CASES in "
                          "tests/support/real_snapshots.py and run that file")
    return (DIRECTORY / file_name(case)).read_bytes()


def main() -> None:
    """Rewrites every case's file with the real instrumentation (needs torch)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from support.torch_helpers import write_real_snapshot

    DIRECTORY.mkdir(exist_ok=True)
    for case in CASES:
        rank, loaders, batches, first, exited = case
        data = write_real_snapshot(rank, loaders, batches, first, exited)
        (DIRECTORY / file_name(case)).write_bytes(data)
        print(DIRECTORY / file_name(case))


if __name__ == "__main__":
    main()
