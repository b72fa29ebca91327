"""Whether the loader tuner finds the best worker count for real data libraries' pipelines.

Next to fixed settings, in one run (the goal: tuned samples/s at least 0.90 of the best
fixed setting's, in every class), by bench/tuner.py's method: every fixed
num_workers (0 to past the cores, persistent) runs before and after the tuned loader,
which starts from num_workers=0 and is measured over the second half of its run. Each
class runs --runs times (3), each run printed, and is judged on the median of the runs'
ratios: on 2 cores some classes' fixed settings tie within the noise, and one run's
best is then the luckiest of them.

  pillow-cnn      JPEG bytes decoded with Pillow, cropped, flipped and resized, then a
                  small CNN's SGD step (the demo's model)
  opencv-threads  JPEG bytes decoded with OpenCV, blurred and resized, with OpenCV's own
                  thread pool left at its default (one thread a core, in every worker)
  tokenizers      sentences encoded by a fast (Rust) tokenizer trained here, padded to
                  128 ids, then an EmbeddingBag model's SGD step
  ddp-cpu         two torchrun ranks (gloo), a DistributedSampler over CPU-bound samples
                  and an all_reduce a step; EPOCHS epochs of EPOCH_SAMPLES a rank measured
                  over the last LAST, fixed persistent counts against loaders tuned from
                  num_workers=0 with persistent_workers=auto and =true (goal as above,
                  and the untuned loader's batches)

Images and text are made here; nothing is downloaded.

    python bench/tuner_libraries.py [--quick] [--strict] [--classes pillow-cnn,ddp-cpu]
                                    [--runs 3]
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/tuner.py, when imported

import cv2
import numpy as np
import torch
import torch.nn.functional as F
from _tuner_common import (
    BATCH,
    CpuSamples,
    ddp_main,
    report_short,
    short_runs,
    verdicts,
)
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from torch import nn
from torch.utils.data import Dataset
from tuner import DemoStep, Kind, class_runs, nothing, report_class

from dataloader_exporter.core import advisor
from dataloader_exporter.core.envnames import ENV_DIR

IMAGES = 32  # distinct encoded images; sample i decodes image i % IMAGES
WORDS = [f"w{i}{'ab'[i % 2] * (i % 5)}" for i in range(3000)]
TOKENS = 128
EPOCHS, EPOCH_SAMPLES = 8, 4096  # the ddp-cpu class's, the last LAST measured (_tuner_common)


def _pictures(side: int) -> list[np.ndarray]:
    """Smooth random pictures (gradients and noise), as photos compress."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(IMAGES):
        small = rng.integers(0, 255, (side // 16, side // 16, 3), dtype=np.uint8)
        big = cv2.resize(small, (side, side), interpolation=cv2.INTER_CUBIC)
        noise = rng.integers(0, 24, big.shape, dtype=np.uint8)
        out.append(cv2.add(big, noise))
    return out


class PillowSamples(Dataset[tuple[int, torch.Tensor]]):
    """JPEG decode, random crop, flip and resize to 3x64x64 with Pillow."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.jpegs = []
        for pic in _pictures(192):
            buf = io.BytesIO()
            Image.fromarray(pic).save(buf, format="JPEG", quality=90)
            self.jpegs.append(buf.getvalue())

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        img = Image.open(io.BytesIO(self.jpegs[i % IMAGES])).convert("RGB")
        x, y = random.randrange(0, 64), random.randrange(0, 64)
        img = img.crop((x, y, x + 128, y + 128)).resize((64, 64), Image.BILINEAR)
        if random.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        pixels = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1)
        return i, pixels.float().div_(255)


class OpenCvSamples(Dataset[tuple[int, torch.Tensor]]):
    """JPEG decode, Gaussian blur and resize with OpenCV's own threads."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.jpegs = [cv2.imencode(".jpg", pic)[1] for pic in _pictures(512)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        img = cv2.imdecode(self.jpegs[i % IMAGES], cv2.IMREAD_COLOR)
        img = cv2.GaussianBlur(img, (9, 9), 0)  # large enough for OpenCV to use its threads
        small = cv2.resize(img, (64, 64), interpolation=cv2.INTER_AREA)
        return i, torch.from_numpy(small).permute(2, 0, 1).float().div_(255)


def _sentence(i: int) -> str:
    rng = random.Random(i)
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(60, 160)))


class TokenSamples(Dataset[tuple[int, torch.Tensor]]):
    """A sentence encoded by a BPE tokenizer (the Rust `tokenizers`), padded to TOKENS."""

    def __init__(self, n: int) -> None:
        self.n = n
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.train_from_iterator((_sentence(i) for i in range(400)),
                                trainers.BpeTrainer(vocab_size=2000,
                                                    special_tokens=["[UNK]", "[PAD]"]))
        tok.enable_padding(pad_id=1, length=TOKENS)
        tok.enable_truncation(TOKENS)
        self.tok = tok

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        ids = self.tok.encode(_sentence(i)).ids
        return i, torch.tensor(ids, dtype=torch.long)


class TokenStep:
    def __init__(self) -> None:
        self.net = nn.Sequential(nn.EmbeddingBag(2000, 64), nn.ReLU(), nn.Linear(64, 10))
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.05)

    def __call__(self, loader: Any, batch: Any) -> None:
        _, ids = loader.to_device(batch, "cpu")
        loss = F.cross_entropy(self.net(ids), torch.zeros(len(ids), dtype=torch.long))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()


def kinds(cores: int) -> dict[str, Kind]:
    counts = tuple(range(0, cores + 2))
    return {"pillow-cnn": Kind("pillow-cnn", PillowSamples, DemoStep(), counts),
            "opencv-threads": Kind("opencv-threads", OpenCvSamples, nothing, counts),
            "tokenizers": Kind("tokenizers", TokenSamples, TokenStep(), counts)}


def ddp_rank() -> int:
    """A rank of the ddp-cpu class, under torchrun (two ranks): prints rank 0's JSON."""
    torch.set_num_threads(1)
    most = max(2, advisor.local_cpu().usable // 2)  # a rank's share of the cores, at least 2
    return ddp_main(data=lambda n: CpuSamples(n, 0.0005), counts=tuple(range(most + 1)),
                    epochs=EPOCHS, samples=EPOCH_SAMPLES)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--classes", default="pillow-cnn,opencv-threads,tokenizers,ddp-cpu")
    ap.add_argument("--ddp-rank", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fixed", type=float, help="seconds per fixed setting (4; --quick 2)")
    ap.add_argument("--tuned", type=float, help="seconds of the tuned run (48; --quick 10)")
    ap.add_argument("--runs", type=int, help="runs of each class (3; --quick 1)")
    ap.add_argument("--quick", action="store_true", help="shorter runs, for a smoke run")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    args = ap.parse_args(argv)
    os.environ.pop(ENV_DIR, None)  # no snapshot thread: the registries are local
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # each sample is one encode
    if args.ddp_rank:
        return ddp_rank()
    fixed_s, tuned_s = (2.0, 10.0) if args.quick else (4.0, 48.0)
    fixed_s = args.fixed if args.fixed is not None else fixed_s
    tuned_s = args.tuned if args.tuned is not None else tuned_s
    runs = args.runs if args.runs is not None else 1 if args.quick else 3
    if fixed_s <= 0 or tuned_s <= 0 or runs < 1:
        ap.error("--fixed, --tuned and --runs must be positive")
    torch.set_num_threads(1)
    cores = advisor.local_cpu().usable
    table = kinds(cores)
    chosen = [c for c in args.classes.split(",") if c]
    unknown = [c for c in chosen if c not in table and c != "ddp-cpu"]
    if unknown:
        ap.error(f"unknown classes {unknown}; known: {', '.join([*table, 'ddp-cpu'])}")
    print(f"torch {torch.__version__}, Pillow {Image.__version__}, OpenCV {cv2.__version__} "
          f"({cv2.getNumThreads()} threads), Python {platform.python_version()}, {cores} "
          f"usable cores, batch {BATCH}; fixed {fixed_s:g} s twice, tuned {tuned_s:g} s",
          flush=True)
    results: dict[str, Any] = {}
    checks: dict[str, bool] = {}
    for name in chosen:
        if name == "ddp-cpu":
            r = short_runs(name, __file__, runs, EPOCHS)
            report_short(name, r, checks)
        else:
            r = class_runs(table[name], fixed_s, tuned_s, runs)
            report_class(name, r, checks)
        results[name] = r
    return verdicts(results, checks, cores, args.quick, args.strict)


if __name__ == "__main__":
    sys.exit(main())
