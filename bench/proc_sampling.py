"""What reading /proc for a loader's workers costs (the budget: at most 1% of one
core for 16 workers, and nothing on the training loop's per-batch path).

A loader with --workers persistent workers (idle after their prefetch, as between a slow
step's batches) is flushed the way the snapshot thread flushes it, forcing a /proc
reading each time; the CPU time (thread_time: the reads are kernel time of this thread)
per reading is the cost of one second of sampling. PSS is read on its own budget
(instrument/procstat.py): its share is reported apart.

    python bench/proc_sampling.py [--workers 16] [--rounds 30] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from prometheus_client import CollectorRegistry
from torch.utils.data import TensorDataset

from dataloader_exporter import instrument

BUDGET = 0.01  # of one core, for 16 workers


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--quick", action="store_true", help="4 workers, 5 rounds")
    args = p.parse_args()
    workers, rounds = (4, 5) if args.quick else (args.workers, args.rounds)
    loader = instrument.DataLoader(TensorDataset(torch.zeros(4096, 8)), batch_size=1,
                                   num_workers=workers, persistent_workers=True,
                                   name="bench", registry=CollectorRegistry())
    it = iter(loader)
    for _ in range(workers * 2):  # every worker has started and reported
        next(it)
    rec = loader._instruments.rec
    tracker = rec.workers
    costs, pss_costs = [], []
    for i in range(rounds):
        tracker._next = 0.0  # a reading is due, as once a second
        tracker.proc._pss._next = 0.0 if i % 10 == 0 else float("inf")
        rec.batches += 1  # batches flowed since the last reading
        t0 = time.thread_time()
        rec.flush(now=time.monotonic())
        (pss_costs if i % 10 == 0 else costs).append(time.thread_time() - t0)
    fig = tracker.proc_figures()
    per_second = statistics.median(costs)
    pss_each = statistics.median(pss_costs) - per_second if pss_costs else 0.0
    # PSS is read so that it takes at most procstat.PSS_BUDGET of a core, whatever it costs.
    share = per_second + min(pss_each, tracker.proc._pss.budget)
    print(f"{workers} workers, {rounds} readings: {per_second * 1000:.2f} ms of CPU a reading "
          f"(once a second: {per_second:.2%} of a core); PSS {pss_each * 1000:.1f} ms a read, "
          f"held to {tracker.proc._pss.budget:.1%}; in all at most {share:.2%} of a core")
    print(f"live workers read: {len(tracker.proc.live)}, RSS "
          f"{((fig.rss_bytes or 0) if fig else 0) / 2**20:.0f} MiB")
    ok = share <= BUDGET * max(1, workers / 16)
    print(f"{'PASS' if ok else 'FAIL'}  at most {BUDGET:.0%} of a core for 16 workers")
    print(json.dumps({"workers": workers, "reading_cpu_seconds": per_second,
                      "pss_read_cpu_seconds": pss_each, "core_share": share, "ok": ok}))
    del it
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
