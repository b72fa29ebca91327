"""Whether the loader tuner finds the best worker count: next to fixed counts, in
one run (the goal: tuned samples/s at least 0.90 of the best fixed count's).

The workload is the demo's: a map-style dataset whose samples cost real CPU work (rendering
and filtering a noisy image, --work filter passes) and an SGD step of comparable cost,
one torch thread in the main process. Loaders, all instrumented into one registry:

  fixed N   num_workers=N for N in 0 .. budget + 1, where budget is the cores the tuner may
            give this rank's workers (advisor.worker_cores: one per core, less one for the
            loop on the CPU); its own model and optimizer
  tuned     tune=True from num_workers=0: it changes its settings at each iter()

Every loader runs one epoch a round, in an order that rotates each round, so the machine's
drift hits all alike. None keeps its workers between epochs (persistent_workers=False: a
pool cannot be persistent at num_workers=0, where the tuned loader starts), so each count
pays the same worker start-up. A figure is samples/s over whole epochs (iter() to the last
step), summed over the measured rounds: those from the first epoch the tuned loader began
settled (its dataloader_tuner_stable gauge, read after its iter()) to the end, for every
loader alike; a tuner still trying at the end is measured over the last round only, and
said so.

    python bench/tuner.py [--quick] [--strict] [--rounds 10] [--samples 512] [--batch 32]
                          [--work 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from prometheus_client import CollectorRegistry

from dataloader_exporter import instrument
from dataloader_exporter.core import advisor
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.core.envnames import ENV_DIR
from dataloader_exporter.demo import BATCH, NoisyImages, model, train_step, tuner_settled
from dataloader_exporter.instrument.tuner_epoch import MIN_BATCHES

MIN_RATIO = 0.90  # the goal: tuned samples/s over the best fixed count's
TUNED = "tuned"


class Run:
    """One loader under test, its own model, and its epochs' samples and seconds."""

    def __init__(self, name: str, samples: int, batch: int, work: int,
                 registry: CollectorRegistry, **kwargs: Any) -> None:
        self.name = name
        self.loader: instrument.DataLoader[tuple[torch.Tensor, int]] = instrument.DataLoader(
            NoisyImages(samples, work), batch_size=batch, shuffle=True, name=name,
            registry=registry, **kwargs)
        self.net = model()
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.05)
        self.epochs: list[tuple[int, float]] = []  # (samples, seconds)
        self.settled_at: int | None = None  # the first round its tuner began settled

    def epoch(self, registry: CollectorRegistry, round_: int) -> None:
        start = time.perf_counter()
        it = iter(self.loader)  # where the tuner changes the settings, or settles
        if self.settled_at is None and self.loader.tune and tuner_settled(registry, self.name):
            self.settled_at = round_
        seen = 0
        for batch in it:
            train_step(self.net, self.opt, self.loader, batch)
            seen += len(batch[1])
        self.epochs.append((seen, time.perf_counter() - start))

    def rate(self, first: int) -> float:
        """Samples/s over the epochs from round `first` on."""
        done = self.epochs[first:]
        return sum(n for n, _ in done) / sum(s for _, s in done)

    def settings(self) -> dict[str, int]:
        out = {"num_workers": self.loader.num_workers}
        if self.loader.num_workers and self.loader.prefetch_factor is not None:
            out["prefetch_factor"] = self.loader.prefetch_factor
        return out


def _changes(registry: CollectorRegistry, name: str) -> dict[str, float]:
    """The tuner's changes as `setting/reason` -> count."""
    out = {}
    for fam in registry.collect():
        for s in fam.samples:
            if (s.name == cat.TUNER_CHANGES.name and s.labels.get("loader") == name
                    and s.value):  # each pair starts at 0
                out[f"{s.labels['setting']}/{s.labels['reason']}"] = s.value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10, help="epochs of each loader (10)")
    ap.add_argument("--samples", type=int, default=512, help="samples an epoch (512)")
    ap.add_argument("--batch", type=int, default=BATCH, help=f"batch size ({BATCH})")
    ap.add_argument("--work", type=int, default=8,
                    help="filter passes a sample: its CPU cost (8, the demo's)")
    ap.add_argument("--quick", action="store_true",
                    help=f"4 rounds of {MIN_BATCHES} batches, for a smoke run")
    ap.add_argument("--strict", action="store_true",
                    help=f"exit 1 when tuned/best is under {MIN_RATIO:.2f}")
    args = ap.parse_args(argv)
    batch = args.batch
    rounds, samples = (4, MIN_BATCHES * batch) if args.quick else (args.rounds, args.samples)
    if rounds < 2 or batch < 1 or samples < MIN_BATCHES * batch or args.work < 0:
        ap.error(f"--rounds must be at least 2, --batch at least 1, --samples at least "
                 f"{MIN_BATCHES} batches (the tuner judges no shorter epoch), --work >= 0")
    os.environ.pop(ENV_DIR, None)  # no snapshot thread: the registry is local
    torch.set_num_threads(1)  # as the demo: workers run one thread each too
    budget = advisor.worker_cores(advisor.local_cpu(), 1, False)
    registry = CollectorRegistry()
    runs = [Run(f"fixed {n}", samples, batch, args.work, registry, num_workers=n)
            for n in range(budget + 2)]
    runs.append(Run(TUNED, samples, batch, args.work, registry, num_workers=0, tune=True))
    tuned = runs[-1]
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} "
          f"CPUs, worker budget {budget}; {rounds} rounds of {samples} samples "
          f"(batch {batch}, work {args.work}), 1 torch thread", flush=True)
    t0 = time.perf_counter()
    for r in range(rounds):
        shift = r % len(runs)
        for run in runs[shift:] + runs[:shift]:  # drift hits all alike
            run.epoch(registry, r)
        rates = ", ".join(f"{run.name} {run.rate(r):.0f}" for run in runs)
        print(f"round {r + 1}/{rounds}: samples/s {rates} "
              f"(tuned at {tuned.settings()})", flush=True)
    settled = tuned.settled_at is not None
    first = tuned.settled_at if tuned.settled_at is not None else rounds - 1
    fixed = {int(run.name.split()[1]): run.rate(first) for run in runs[:-1]}
    best = max(fixed, key=lambda n: fixed[n])
    tuned_rate = tuned.rate(first)
    ratio = tuned_rate / fixed[best]
    over = f"rounds {first + 1}-{rounds}" if first < rounds - 1 else f"round {rounds}"
    when = "after the tuner settled" if settled else "the tuner had not settled"
    print(f"\nsamples/s over {over} ({when}); benchmark took "
          f"{time.perf_counter() - t0:.0f} s")
    for n, rate in fixed.items():
        print(f"  {f'num_workers={n}':<16}{rate:8.0f}{'  best' if n == best else ''}")
    changes = _changes(registry, TUNED)
    print(f"  {'tuned':<16}{tuned_rate:8.0f}  from num_workers=0 to {tuned.settings()}; "
          f"changes {changes or 'none'}")
    print(f"  tuned / best = {ratio:.2f}")
    checks = {f"tuned/best >= {MIN_RATIO:.2f}": ratio >= MIN_RATIO, "tuner settled": settled}
    for label, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {label}")
    result = {"fixed": {str(n): round(v, 1) for n, v in fixed.items()}, "best": best,
              "tuned": {"samples_per_s": round(tuned_rate, 1), "settings": tuned.settings(),
                        "settled_round": first + 1 if settled else None,
                        "changes": changes},
              "ratio": round(ratio, 4), "budget": budget, "rounds": rounds,
              "measured_rounds": rounds - first, "samples": samples, "batch": batch,
              "work": args.work,
              "quick": args.quick, "torch": torch.__version__,
              "python": platform.python_version(), "cpus": os.cpu_count(), "checks": checks}
    print(json.dumps(result, sort_keys=True))
    return 1 if args.strict and not all(checks.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
