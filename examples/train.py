"""A short instrumented training run on the CPU that prints what the loader measured.

    python examples/train.py [--epochs 2] [--workers 2] [--metrics-dir DIR] [--port PORT]

The docker-compose trainer runs it with --epochs 0 (until stopped).

The dataset does real CPU work per sample (it renders a noisy image), so the input
pipeline matters; the model is a small CNN.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import math
import time

import torch
from torch import nn
from torch.utils.data import Dataset

import instrument
from exporter import catalogue as cat


class SyntheticImages(Dataset):  # type: ignore[type-arg]
    """Generated 3x64x64 images with a label; each costs ~1 ms of CPU to make."""

    def __init__(self, n: int, size: int = 64, work: int = 4) -> None:
        self.n, self.size, self.work = n, size, work

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        img = torch.rand(3, self.size, self.size, generator=g)
        for _ in range(self.work):  # stand-in for decoding and augmentation
            img = torch.nn.functional.avg_pool2d(img.unsqueeze(0), 3, 1, 1).squeeze(0)
            img = (img + 0.05 * torch.randn(img.shape, generator=g)).clamp(0, 1)
        return img, i % 10


def model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(8),
                         nn.Flatten(), nn.Linear(16 * 8 * 8, 10))


def summary(registry: object, name: str) -> str:
    get = registry.get_sample_value  # type: ignore[attr-defined]
    labels = {"loader": name, "rank": "0"}
    fetch = get(cat.TIME.name + "_sum", {**labels, "phase": cat.PHASE_FETCH}) or 0.0
    step = get(cat.STEP.name + "_sum", labels) or 0.0
    batches = get(cat.BATCHES.name, labels) or 0
    samples = get(cat.SAMPLES.name, labels) or 0
    first = get(cat.FIRST_BATCH.name + "_sum", labels) or 0.0
    epochs = get(cat.EPOCHS.name, labels) or 1
    share = fetch / (fetch + step) if fetch + step else math.nan
    return (f"{name}: {int(batches)} batches, {int(samples)} samples; input stall share "
            f"{share:.0%} (fetch wait {fetch:.2f} s vs step {step:.2f} s); "
            f"first batch {first / epochs:.2f} s per epoch")


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
    loader = instrument.DataLoader(
        SyntheticImages(args.samples), batch_size=32, shuffle=True, num_workers=args.workers,
        persistent_workers=args.workers > 0, name="train", metrics_dir=args.metrics_dir,
        port=args.port)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    t0 = time.perf_counter()
    for epoch in itertools.count() if args.epochs == 0 else range(args.epochs):
        for x, y in loader:
            x, y = loader.to_device((x, y), "cpu")
            loss = nn.functional.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"epoch {epoch}: loss {loss.item():.3f}")
    print(f"{time.perf_counter() - t0:.1f} s")
    print(summary(instrument.default_registry(), "train"))


if __name__ == "__main__":
    main()
