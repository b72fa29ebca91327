"""What the tuner benchmarks (tuner.py, tuner_libraries.py) share: their goal and batch
size, synthetic samples that cost CPU or wait on storage, the short-epoch classes (one
process, or two torchrun ranks through a script's --ddp-rank), and their report."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from prometheus_client import CollectorRegistry
from torch.utils.data import Dataset

from dataloader_exporter import instrument

MIN_RATIO = 0.90  # tuned samples/s over the best fixed setting's, every class
BATCH = 16


def burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class CpuSamples(Dataset[tuple[int, torch.Tensor]]):
    """Each sample costs `cpu` seconds of CPU; returns its index and a small tensor."""

    def __init__(self, n: int, cpu: float) -> None:
        self.n, self.cpu = n, cpu

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        burn(self.cpu)
        return i, torch.full((64,), float(i))


class StorageSamples(CpuSamples):
    """Each sample waits `wait` seconds (storage latency), then costs `cpu` of CPU."""

    def __init__(self, n: int, wait: float, cpu: float) -> None:
        super().__init__(n, cpu)
        self.wait = wait

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        time.sleep(self.wait)
        return super().__getitem__(i)


EPOCHS, LAST, EPOCH_SAMPLES = 10, 3, 2048
KEPT = (8, 16, 32)  # fixed persistent worker counts the short-epoch classes compare with


def _interleaved(loaders: dict[str, tuple[Any, Any]], step: Callable[[], None],
                 epochs: int = EPOCHS, last: int = LAST
                 ) -> tuple[dict[str, float], dict[str, float], dict[str, list[list[int]]]]:
    """Each loader's (loader, sampler) samples/s over the last `last` of `epochs` epochs,
    over the epochs before them but the first (`early`: where the best fixed setting is
    chosen, see short_class), and each epoch's sample indices. The loaders take turns an
    epoch at a time, the order rotated each epoch, so that all are measured over the same
    minutes of a machine whose speed drifts (persistent pools wait idle for their turn)."""
    names = list(loaders)
    spent, seen = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
    early_spent, early_seen = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
    order: dict[str, list[list[int]]] = {k: [] for k in names}
    for e in range(epochs):
        turn = e % len(names)
        for name in names[turn:] + names[:turn]:
            loader, sampler = loaders[name]
            if sampler is not None:
                sampler.set_epoch(e)
            t0, idx = time.perf_counter(), []
            for batch in loader:
                idx += [int(i) for i in batch[0]]
                step()
            if e >= epochs - last:
                spent[name] += time.perf_counter() - t0
                seen[name] += len(idx)
            elif e >= 1:
                early_spent[name] += time.perf_counter() - t0
                early_seen[name] += len(idx)
            order[name].append(idx)
    return ({k: seen[k] / spent[k] for k in names},
            {k: early_seen[k] / early_spent[k] for k in names if early_spent[k]}, order)


def storage(n: int) -> Dataset[Any]:
    return StorageSamples(n, 0.004, 0.0002)


def short_epochs(ddp: bool, data: Callable[[int], Dataset[Any]] = storage,
                 counts: tuple[int, ...] = KEPT, epochs: int = EPOCHS,
                 samples: int = EPOCH_SAMPLES) -> dict[str, Any]:
    """One process's (or, under torchrun, this rank's) short-epoch class (tuner.py): `data`
    of n samples, fixed persistent pools of `counts` and the tuned loaders taking turns an
    epoch at a time (_interleaved), `epochs` of `samples` a rank."""
    import torch.distributed as dist

    registry = CollectorRegistry()
    ranks = dist.get_world_size() if ddp else 1
    n = samples * ranks
    dataset = data(n)

    def sampler() -> Any:
        return (torch.utils.data.distributed.DistributedSampler(range(n), shuffle=True,
                                                                 seed=1) if ddp else None)

    def build(cls: Any, name: str, over: Any = dataset, **kw: Any) -> tuple[Any, Any]:
        s = sampler()
        extra = {} if cls is torch.utils.data.DataLoader else {"name": name,
                                                                "registry": registry}
        return cls(over, batch_size=BATCH, sampler=s, shuffle=s is None,
                   generator=torch.Generator().manual_seed(1), **extra, **kw), s

    def step() -> None:
        if ddp:
            dist.all_reduce(torch.zeros(1))

    loaders = {f"fixed-{w}": build(instrument.DataLoader, f"kept-{w}", num_workers=w,
                                   persistent_workers=w > 0) for w in counts}
    # An A/A control: the largest fixed pool once more. Its ratio to that pool is the
    # resolution of a ratio over the last epochs (a tuned loader's cannot be finer).
    w = counts[-1]
    loaders["again"] = build(instrument.DataLoader, f"again-{w}", num_workers=w,
                             persistent_workers=w > 0)
    both = ("num_workers", "prefetch_factor")
    for label, kw in (("auto", {"tune": (*both, "persistent_workers")}),
                      ("true", {"tune": both, "persistent_workers": True})):
        loaders[label] = build(instrument.DataLoader, f"tuned-{label}", num_workers=0, **kw)
    rates, early, orders = _interleaved(loaders, step, epochs)
    for label in ("auto", "true"):
        rates[f"{label}-workers"] = float(loaders[label][0].num_workers)
    del loaders
    bare, s = build(torch.utils.data.DataLoader, "", over=range(n))
    orders["untuned"] = []
    for e in range(epochs):
        if s is not None:
            s.set_epoch(e)
        orders["untuned"].append([int(i) for b in bare for i in b])
    same = {label: orders[label] == orders["untuned"] for label in ("auto", "true")}
    return {"rates": rates, "early": {k: v for k, v in early.items() if k.startswith("fixed-")},
            "same": same, "twin": f"fixed-{w}"}


def ddp_main(**kw: Any) -> int:
    """A rank of a two-rank short-epoch class (short_epochs' `kw`), under torchrun: prints
    rank 0's JSON."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        torch.set_num_threads(1)
        mine = short_epochs(True, **kw)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    finally:
        dist.destroy_process_group()
    if os.environ.get("RANK") == "0":
        rates = {k: sum(r["rates"][k] for r in everyone) for k in mine["rates"]
                 if not k.endswith("-workers")}
        rates.update({k: v for k, v in mine["rates"].items() if k.endswith("-workers")})
        early = {k: sum(r["early"][k] for r in everyone) for k in mine["early"]}
        same = {k: all(r["same"][k] for r in everyone) for k in mine["same"]}
        print("DDP " + json.dumps({"rates": rates, "early": early, "same": same,
                                   "twin": mine["twin"]}), flush=True)
    return 0


def short_class(name: str, script: str) -> dict[str, Any]:
    """storage-epochs in this process; a DDP class under torchrun, `script --ddp-rank`."""
    if name == "storage-epochs":
        r = short_epochs(ddp=False)
    else:
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run",
                              "--nproc_per_node", "2", script, "--ddp-rank"],
                             capture_output=True, text=True, timeout=900, check=True)
        [line] = [x for x in out.stdout.splitlines() if x.startswith("DDP ")]
        r = json.loads(line[4:])
    fixed = {k: v for k, v in r["rates"].items() if k.startswith("fixed-")}
    # The best fixed setting is the one a person measuring them would choose: the fastest
    # over the epochs before the last LAST, then compared over the last LAST. Chosen over
    # the same epochs it is compared on, the fastest of a few equally good pools is the one
    # whose epochs were luckiest: a bar that a tuned loader at the same setting misses by
    # that luck (the "max" ratio, printed beside it).
    best = max(r["early"], key=lambda k: r["early"][k])
    top = max(fixed, key=lambda k: fixed[k])
    r["best"] = best
    r["ratio"] = {k: round(r["rates"][k] / fixed[best], 3) for k in ("auto", "true")}
    r["ratio_to_max"] = {k: round(r["rates"][k] / fixed[top], 3) for k in ("auto", "true")}
    r["aa"] = round(r["rates"]["again"] / fixed[r["twin"]], 3)  # the pool "again" repeats
    return r


def short_runs(name: str, script: str, runs: int, epochs: int = EPOCHS) -> dict[str, Any]:
    """The short-epoch class `name` run `runs` times (short_class), each run's line printed
    as it ends. With more than one: each ratio (and the A/A control's) is the median of
    the runs' (a run's ratio over LAST short epochs is as coarse as its A/A control says),
    the batches the same only where they were in every run; the runs under "runs"."""
    each = []
    for _ in range(runs):
        each.append(r := short_class(name, script))
        print(short_line(name, r, epochs), flush=True)
    if runs == 1:
        return each[0]
    labels = ("auto", "true")
    return {"runs": each,
            "ratio": {k: statistics.median(r["ratio"][k] for r in each) for k in labels},
            "ratio_to_max": {k: statistics.median(r["ratio_to_max"][k] for r in each)
                             for k in labels},
            "aa": statistics.median(r["aa"] for r in each),
            "same": {k: all(r["same"][k] for r in each) for k in labels}}


def short_line(name: str, r: dict[str, Any], epochs: int = EPOCHS) -> str:
    """One run's line of a short-epoch class."""
    rates = ", ".join(f"{k}: {v:.0f}" for k, v in r["rates"].items())
    return (f"{name:<14} samples/s over the last {LAST} of {epochs} epochs {{{rates}}}; "
            f"tuned/best ({r['best']}, chosen over epochs 1-{epochs - LAST - 1}) "
            f"{r['ratio']}; tuned/max of the last {LAST} {r['ratio_to_max']}; A/A control "
            f"(the largest fixed pool again) {r['aa']}; same batches {r['same']}")


def report_short(name: str, r: dict[str, Any], checks: dict[str, bool]) -> None:
    """Prints a short-epoch class's medians where it ran more than once (short_runs), and
    adds its checks."""
    if "runs" in r:
        print(f"{name:<14} median of {len(r['runs'])} runs: tuned/best {r['ratio']}; "
              f"tuned/max of the last {LAST} {r['ratio_to_max']}; A/A control {r['aa']}; "
              f"same batches in every run {r['same']}", flush=True)
    for label in ("auto", "true"):
        checks[f"{name} persistent_workers={label}: tuned/best >= {MIN_RATIO:.2f}"] = \
            r["ratio"][label] >= MIN_RATIO
        checks[f"{name} persistent_workers={label}: same batches as untuned"] = \
            r["same"][label]


def verdicts(results: dict[str, Any], checks: dict[str, bool], cores: int, quick: bool,
             strict: bool) -> int:
    """Prints each check and the run's JSON summary (last); the exit status."""
    for label, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {label}")
    print(json.dumps({"results": results, "checks": checks, "cores": cores, "quick": quick,
                      "torch": torch.__version__}, sort_keys=True))
    return 1 if strict and not all(checks.values()) else 0
