"""What the framework scripts share: a tiny dataset, and their own record of the truth.

No exporter code: the scripts run under `dataloader-exporter run`, and they record
what they did (steps per epoch) and what their snapshot file said while batches flowed,
read as a plain file, for the tests to compare with the metrics.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

import torch
from torch.utils.data import Dataset


class Points(Dataset):  # type: ignore[type-arg]
    """n samples of 4 features and a target, the same on every rank."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = self.x.sum(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def site() -> str:
    """The name zero-code mode gives a loader built on the caller's line: FILE:LINE, and
    its caller's FILE:LINE after a '-' when that line is in a function (naming.py)."""
    def at(frame: object) -> str:
        return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"  # type: ignore[attr-defined]

    caller = sys._getframe(1)
    if caller.f_code.co_name != "<module>" and caller.f_back is not None:
        return f"{at(caller)}-{at(caller.f_back)}"
    return at(caller)


def snapshot_value(name: str, loader: str, deadline_s: float = 15.0, at_least: float = 0.0
                   ) -> float | None:
    """A loader's sample in this process's own snapshot file once it reaches `at_least`."""
    directory = os.environ.get("DATALOADER_EXPORTER_DIR", "")
    end = time.monotonic() + deadline_s
    value = None
    while time.monotonic() < end:
        for path in glob.glob(os.path.join(directory, f"*-{os.getpid()}-*.prom")):
            with open(path) as f:
                for line in f:
                    if line.startswith(f'{name}{{loader="{loader}",'):
                        value = float(line.rsplit(" ", 1)[1])
        if value is not None and value >= at_least:
            return value
        time.sleep(0.05)
    return value


def workers_seen(steps: int, loader: str) -> dict[str, float | None]:
    """workers_active and lost as the snapshot shows them once it has `steps` batches."""
    batches = snapshot_value("dataloader_batches_total", loader, at_least=steps)
    return {"batches": batches,
            "active": snapshot_value("dataloader_workers_active", loader),
            "lost": snapshot_value("dataloader_workers_lost_total", loader)}


def record(out: str, rank: int, **facts: object) -> None:
    with open(os.path.join(out, f"truth-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "pid": os.getpid(), **facts}, f)
