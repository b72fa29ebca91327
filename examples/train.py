"""A short instrumented training run on the CPU that prints what the loader measured.

    python examples/train.py [--epochs 2] [--workers 2] [--metrics-dir DIR] [--port PORT]

The docker-compose trainer runs it with --epochs 0 (until stopped). The dataset and the
model are the demo's: samples cost real CPU work, so the input pipeline matters.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import time

import torch
from prometheus_client import generate_latest

import dataloader_exporter
from dataloader_exporter.demo import NoisyImages, model, train_step
from dataloader_exporter.diagnosis.signals import Scrape, Window, loaders


def summary(name: str) -> str:
    """The run so far, read back through the same signals the doctor uses."""
    now = Scrape.parse(generate_latest(dataloader_exporter.default_registry()).decode())
    s = next(x for x in loaders(Window.whole_run(now)) if x.loader == name)
    share = "-" if s.stall_share is None else f"{s.stall_share:.0%}"
    samples = "unknown" if s.samples is None else f"{s.samples:.0f}"
    return (f"{name}: {s.batches:.0f} batches, {samples} samples; input stall share "
            f"{share} (fetch wait {s.fetch_seconds:.2f} s vs step {s.step_seconds:.2f} s); "
            f"first batch {s.first_batch_mean or 0:.2f} s per epoch")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--epochs", type=int, default=2, help="0: train until stopped")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--metrics-dir", default=None)
    ap.add_argument("--port", type=int, default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    torch.manual_seed(0)
    loader = dataloader_exporter.DataLoader(
        NoisyImages(args.samples), batch_size=32, shuffle=True, num_workers=args.workers,
        persistent_workers=args.workers > 0, name="train", metrics_dir=args.metrics_dir,
        port=args.port)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    t0 = time.perf_counter()
    for epoch in itertools.count() if args.epochs == 0 else range(args.epochs):
        for batch in loader:
            loss = train_step(net, opt, loader, batch)
        print(f"epoch {epoch}: loss {loss.item():.3f}; {summary('train')}", flush=True)
    print(f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
