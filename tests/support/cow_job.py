"""A job for test_copy_on_read.py: a dataset that holds 3,000,000 file paths, as a Python
list of str (each worker copies the pages of the items it reads: copy-on-read) or as one
numpy array of bytes (nothing to copy), read by 2 persistent workers of a loader named
`cow`, epoch after epoch, until the file <out>/stop appears or a worker dies.

Each item reads CHUNK consecutive paths and sleeps PACE seconds (storage), so that the
workers' private memory grows by about 90 KiB per item of the list (under 2 MiB/s each),
slowly enough to be read many times before it reaches any limit. Its workers offer
themselves to the OOM killer first (prefer_me). After building the dataset the job writes
<out>/ready (its memory cgroup's usage, where it is in one) and waits for <out>/go, so
that a test can set a limit above what it holds. The instrumentation's log lines go to
<out>/log.txt; the exception that ended the loop, if any, to <out>/error.txt.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import numpy as np
import torch

from dataloader_exporter import instrument

CHUNK = 1000


def prefer_me(worker_id: int) -> None:
    """A worker offers itself to the OOM killer before the trainer (raising one's own
    oom_score_adj needs no privilege): the kernel otherwise may pick the main process,
    whose resident memory is about a worker's, and a test would see no worker die."""
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("500")


class Paths(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, as_numpy: bool, pace: float) -> None:
        paths = [f"/data/train/{i // 1000:05d}/{i:09d}.jpg" for i in range(n)]
        self.paths = np.array(paths, dtype="S") if as_numpy else paths
        self.pace = pace

    def __len__(self) -> int:
        return len(self.paths) // CHUNK

    def __getitem__(self, i: int) -> int:
        time.sleep(self.pace)
        return sum(len(p) for p in self.paths[i * CHUNK:(i + 1) * CHUNK])


def cgroup_usage() -> int:
    """The memory cgroup v1 usage of this process's group, or 0."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            usage = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.usage_in_bytes"
            try:
                return int(usage.read_text())
            except OSError:
                return 0
    return 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kind", choices=("list", "numpy"), required=True)
    p.add_argument("--items", type=int, default=3_000_000)
    p.add_argument("--pace", type=float, default=0.05)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--port", type=int, default=None)
    args = p.parse_args()
    out: Path = args.out
    handler = logging.FileHandler(out / "log.txt")
    handler.setLevel(logging.INFO)
    logging.getLogger("dataloader_exporter").addHandler(handler)
    logging.getLogger("dataloader_exporter").setLevel(logging.INFO)
    dataset = Paths(args.items, args.kind == "numpy", args.pace)
    (out / "ready").write_text(str(cgroup_usage()))
    while not (out / "go").exists():
        time.sleep(0.05)
    loader = instrument.DataLoader(dataset, batch_size=4, shuffle=True, num_workers=2,
                                   persistent_workers=True, name="cow", port=args.port,
                                   worker_init_fn=prefer_me,
                                   metrics_dir=str(out / "m"))
    try:
        while not (out / "stop").exists():
            for _ in loader:
                if (out / "stop").exists():
                    break
    except Exception as e:  # a worker killed: what the loop saw
        (out / "error.txt").write_text(f"{type(e).__name__}: {e}")
        raise


if __name__ == "__main__":
    main()
