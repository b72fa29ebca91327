"""What looking at a dataset for copy-on-read costs (instrument/cowscan.py), once per loader
before its first workers start: median and worst of repeated scans, for datasets with
nothing to name and with large containers of every kind, each next to its budget.

    python bench/cowscan.py            # 200 scans of each dataset
    python bench/cowscan.py --quick    # 20

Targets (docs/performance.md): under 1 ms for a dataset without large containers; at
most cowscan.SCAN_BUDGET (10 ms) plus the object in hand for any dataset (the scan stops
there with what it found). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, Subset, TensorDataset

from dataloader_exporter.instrument.cowscan import SCAN_BUDGET, scan

N = 3_000_000


class Plain(Dataset):  # type: ignore[type-arg]
    """A typical dataset with nothing to name: a root, a transform, numpy arrays."""

    def __init__(self) -> None:
        self.root = "/data/train"
        self.transform = None
        self.paths = np.array([f"/data/train/{i:09d}.jpg".encode() for i in range(10_000)])
        self.labels = np.arange(10_000)
        self.classes = [f"class{i}" for i in range(1000)]

    def __len__(self) -> int:
        return len(self.labels)


class Listed(Dataset):  # type: ignore[type-arg]
    """3,000,000 paths in a list and their labels in a dict: two containers to name."""

    def __init__(self) -> None:
        self.paths = [f"/data/train/{i:09d}.jpg" for i in range(N)]
        self.labels = {p: i % 1000 for i, p in enumerate(self.paths[: N // 3])}

    def __len__(self) -> int:
        return len(self.paths)


class Wide(Dataset):  # type: ignore[type-arg]
    """Many attributes, and lists of datasets: the scan's bound, not its usual cost."""

    def __init__(self, inner: Dataset) -> None:  # type: ignore[type-arg]
        for i in range(200):
            setattr(self, f"a{i}", [inner] * 3 if i % 10 == 0 else np.zeros(4))


def timed(dataset: Any, rounds: int) -> dict[str, float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        scan(dataset)
        times.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": statistics.median(times), "max_ms": max(times)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="20 scans of each, not 200")
    args = p.parse_args()
    rounds = 20 if args.quick else 200
    listed = Listed()
    cases = {
        "plain (nothing to name)": (Plain(), 1.0),
        "tensors (nothing to name)": (TensorDataset(torch.zeros(1000, 8)), 1.0),
        "list of 3M str + dict of 1M": (listed, SCAN_BUDGET * 1e3),
        "Subset of ConcatDataset of it": (Subset(ConcatDataset([Plain(), listed]), [0]),
                                          SCAN_BUDGET * 1e3),
        "200 attributes, 20 lists of it": (Wide(listed), SCAN_BUDGET * 1e3),
    }
    results = {}
    for name, (dataset, budget) in cases.items():
        got = timed(dataset, rounds)
        results[name] = {**got, "budget_ms": budget, "found": [c.attribute for c in scan(dataset)]}
        print(f"{name:32s} median {got['median_ms']:7.3f} ms  max {got['max_ms']:7.3f} ms  "
              f"(budget {budget:g} ms)  {results[name]['found']}")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
