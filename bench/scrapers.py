"""What scrapers of the in-process server cost the training loop, side by side in one run.

The trainer (this process) runs an instrumented loader and a step of pure Python work
(which holds the interpreter lock, like a step launching GPU kernels) and serves its
metrics in-process. Clients run in another process, so they take none of the trainer's
interpreter lock themselves: whatever they cost it is the server's work. With two cores or
more the trainer is pinned to one core and the clients to another.

Phases, interleaved in rounds so that drift hits all alike:
  none      no client
  1/s       one scrape a second (Prometheus)
  tight     one client scraping in a loop (a `watch curl`, a 10 ms scrape interval)
  50        fifty clients scraping in a loop at once

Each client phase runs against the server as the trainer serves it (paced: the
in-process limits) and against the same server without pacing (the limits the sidecar
uses), both serving the trainer's registry. Each phase's figure is the trainer's steps/s
over it, as a ratio to `none` in the same round; the median over rounds is printed.

    python bench/scrapers.py [--seconds 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CLIENTS = {"none": (0, 0.0), "1/s": (1, 1.0), "tight": (1, 0.0), "50": (50, 0.0)}
PHASES = ("none", *(f"{c} {v}" for c in ("1/s", "tight", "50") for v in ("paced", "unpaced")))


def _client(url: str, threads: int, period: float, stop: mp.synchronize.Event,
            core: int | None, counts: mp.Array) -> None:  # type: ignore[type-arg]
    if core is not None:
        os.sched_setaffinity(0, {core})

    def loop(i: int) -> None:
        while not stop.is_set():
            start = time.monotonic()
            try:
                with urllib.request.urlopen(url, timeout=30) as r:
                    r.read()
                counts[i] += 1
            except OSError:
                pass
            if period:
                stop.wait(max(0.0, period - (time.monotonic() - start)))

    pool = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="each phase's length")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import torch
    from prometheus_client import CollectorRegistry
    from torch.utils.data import TensorDataset

    from dataloader_exporter import instrument
    from dataloader_exporter.exporter.web.server import Limits, serve

    cores = sorted(os.sched_getaffinity(0))
    trainer_core = cores[0] if len(cores) > 1 else None
    client_core = cores[1] if len(cores) > 1 else None
    if trainer_core is not None:
        os.sched_setaffinity(0, {trainer_core})
    reg = CollectorRegistry()
    loader = instrument.DataLoader(TensorDataset(torch.arange(4096.0)), batch_size=8,
                                   name="train", registry=reg)
    handle = instrument.serve(0, addr="127.0.0.1", registry=reg, system_metrics=True)
    unpaced = serve(reg, "127.0.0.1", 0, None, Limits())
    urls = {"paced": handle.url + "/metrics", "unpaced": unpaced.url + "/metrics"}

    def steps_for(seconds: float) -> float:
        n, end = 0, time.perf_counter() + seconds
        start = time.perf_counter()
        while True:
            for _ in loader:
                x = 0
                for i in range(20_000):  # about 1 ms of pure Python: the GIL held
                    x += i
                n += 1
                if time.perf_counter() >= end:
                    return n / (time.perf_counter() - start)

    ctx = mp.get_context("spawn")
    ratios: dict[str, list[float]] = {p: [] for p in PHASES}
    served: dict[str, list[float]] = {p: [] for p in PHASES}
    steps_for(1.0)  # warm up
    for round_ in range(args.rounds):
        rate: dict[str, float] = {}
        for phase in PHASES if round_ % 2 == 0 else PHASES[::-1]:  # drift hits all alike
            clients, _, variant = phase.partition(" ")
            threads, period = CLIENTS[clients]
            url = urls.get(variant, "")
            stop = ctx.Event()
            counts = ctx.Array("l", max(threads, 1))
            proc = None
            if threads:
                proc = ctx.Process(target=_client, args=(url, threads, period, stop,
                                                         client_core, counts))
                proc.start()
                time.sleep(1.0)  # the clients under way
            before = sum(counts)
            rate[phase] = steps_for(args.seconds)
            served[phase].append((sum(counts) - before) / args.seconds)
            stop.set()
            if proc is not None:
                proc.join(timeout=60)
        for phase in PHASES:
            ratios[phase].append(rate[phase] / rate["none"])
    handle.shutdown()
    unpaced.shutdown()
    print(f"cores {len(cores)} (trainer on {trainer_core}, clients on {client_core}); "
          f"{args.rounds} rounds of {args.seconds:g} s a phase")
    for phase in PHASES:
        print(f"  {phase:14s} steps/s {statistics.median(ratios[phase]):.2f}x of none; "
              f"scrapes answered {statistics.median(served[phase]):.0f}/s")


if __name__ == "__main__":
    main()
