"""What the snapshot writer costs an idle trainer: a loader that ran and now waits (between
epochs, or a finished loop), its workers alive where it has them.

Two writers over the same loader, side by side: "always" renders and writes every
interval (SnapshotWriter.write), "idle-aware" runs SnapshotWriter.tick (the write skipped,
the file only touched, while nothing was recorded, at most REFRESH_EVERY - 1 intervals in
a row). Their intervals alternate in rounds, each timed on the ticking thread's CPU
clock; the kernel's share (getrusage) is what ran with the interpreter lock released.
Intervals are a real second apart, so that the workers' liveness and /proc readings come
at their own pace (at most one a 0.9 s, PSS within its budget). Figures per second:

    python bench/background_idle.py [--rounds 4] [--ticks 10] [--quick]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from time import thread_time_ns
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from prometheus_client import CollectorRegistry
from torch.utils.data import TensorDataset

from dataloader_exporter import instrument
from dataloader_exporter.instrument.hub import hub_for
from dataloader_exporter.instrument.snapshot_writer import SnapshotWriter

SPECS = {"no workers": 0, "2 workers": 2}  # name -> num_workers (persistent)


def _sys_s() -> float:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return float(r.ru_stime)


def idle_loader(workers: int) -> tuple[Any, Any, CollectorRegistry]:
    """A loader that ran 64 batches and now waits, the iterator it waits in, its registry."""
    ds = TensorDataset(torch.randn(4096, 16), torch.randint(0, 10, (4096,)))
    registry = CollectorRegistry()
    loader = instrument.DataLoader(ds, batch_size=32, num_workers=workers, registry=registry,
                                   persistent_workers=workers > 0, name=f"idle{workers}")
    it = iter(loader)
    for _ in range(64):
        next(it)
    return loader, it, registry


def measure(rounds: int, ticks: int, directory: str, interval: float = 1.0
            ) -> dict[str, dict[str, Any]]:
    """Per loader, per writer: CPU ns of each interval, the kernel's seconds, the skips."""
    out: dict[str, dict[str, Any]] = {}
    for name, workers in SPECS.items():
        loader, it, loader_registry = idle_loader(workers)
        hub = hub_for(loader_registry)
        registry = hub._snapshot_registry()
        writers = {"always": SnapshotWriter(registry, directory, 1.0),
                   "idle-aware": SnapshotWriter(registry, directory, 1.0,
                                                activity=hub.activity)}
        figures: dict[str, dict[str, Any]] = {w: {"cpu_ns": [], "sys_s": 0.0}
                                              for w in writers}
        for r in range(rounds):
            order = list(writers) if r % 2 == 0 else list(reversed(writers))
            for w in order:
                writer, fig = writers[w], figures[w]
                for _ in range(ticks):
                    time.sleep(interval)
                    s0, c0 = _sys_s(), thread_time_ns()
                    writer.write() if w == "always" else writer.tick()
                    fig["cpu_ns"].append(thread_time_ns() - c0)
                    fig["sys_s"] += _sys_s() - s0
        for w, writer in writers.items():
            figures[w]["writes"], figures[w]["skips"] = writer.writes, writer.skips
        out[name] = figures
        del it, loader
    return out


def report(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Prints the table; the figures for the JSON line."""
    print(f"{'idle loader':12} {'writer':11} {'written':>8} {'skipped':>8} {'CPU ms/s':>9} "
          f"{'held ms/s':>10} {'p50 per interval':>17}")
    summary: dict[str, Any] = {}
    for name, figures in results.items():
        for w, fig in figures.items():
            cpu = fig["cpu_ns"]
            cpu_ms = sum(cpu) / len(cpu) / 1e6
            kernel = min(1.0, fig["sys_s"] * 1e9 / max(sum(cpu), 1))
            held = cpu_ms * (1 - kernel)
            print(f"{name:12} {w:11} {fig['writes']:8} {fig['skips']:8} {cpu_ms:9.3f} "
                  f"{held:10.3f} {statistics.median(cpu) / 1e3:14.0f} us")
            summary[f"{name} {w}"] = {"cpu_ms_per_s": round(cpu_ms, 3),
                                      "held_ms_per_s": round(held, 3)}
        ratio = (summary[f"{name} idle-aware"]["cpu_ms_per_s"]
                 / max(summary[f"{name} always"]["cpu_ms_per_s"], 1e-9))
        summary[f"{name} ratio"] = round(ratio, 3)
        print(f"{name:12} idle-aware / always: {ratio:.2f}x CPU")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--ticks", type=int, default=10, help="intervals per writer and round")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 5 intervals")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.ticks = 2, 5
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as directory:
        results = measure(args.rounds, args.ticks, directory)
    summary = report(results)
    print(json.dumps({"bench": "background_idle", "rounds": args.rounds,
                      "ticks": args.ticks, **summary}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
