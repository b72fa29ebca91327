"""One short run on a machine with an NVIDIA GPU: instrument's CUDA paths and the NVML collector.

  events   to_device(pinned batch, non_blocking=True) brackets each copy with CUDA events;
           after synchronize and a scrape (which flushes the recorder) the transfer
           histogram counts every copy, and its sum is within SANE_FACTOR of CUDA events
           around a plain .to() of the same batches.
  bytes    dataloader_transfer_bytes_total is the batches' nbytes; batch_bytes one batch's.
  overlap  steps alternate heavy-GPU/light-host and light-GPU/heavy-host work, so only a loop
           whose copies do not block the host keeps both busy. Instrumented to_device must take
           the wall time of plain .to(); a control that synchronizes after .to() must not
           (else the test could not see a sync). Synchronize calls are also counted, and
           torch's sync-debug warnings (implicit syncs such as .item()).
  nvml     GpuCollector over the real pynvml, one scrape: at least one GPU, collector up.
  uuid     after one to_device onto CUDA, dataloader_info's gpu_uuid is one of NVML's GPU
           UUIDs (the join key between a rank and its GPU's utilization).

    python bench/gpu_check.py        (prints "SKIP: no CUDA" and exits 0 without a GPU)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from time import perf_counter
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from prometheus_client import CollectorRegistry
from torch.utils.data import DataLoader, TensorDataset

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.core.envnames import ENV_DIR
from dataloader_exporter.instrument.rank import current_rank

BATCH, WIDTH, BATCHES = 64, 32_768, 40  # 8 MiB batches: a copy takes ~10x its host-side launch
SANE_FACTOR = 3.0  # instrumented transfer time vs the reference, either way
MAX_OVERLAP_RATIO = 1.15  # instrumented / plain wall time; the control must exceed it
HEAVY_S, LIGHT_S = 0.004, 0.0005  # GPU and host work per overlapped step
Result = tuple[str, str, dict[str, Any]]  # status (PASS, FAIL, SKIP), check, details
Event = torch.cuda.Event


def labels(loader: str, **extra: str) -> dict[str, str]:
    return {"loader": loader, "rank": current_rank(), **extra}


def dataset(batches: int, width: int = WIDTH) -> TensorDataset:
    n = batches * BATCH
    return TensorDataset(torch.rand(n, width), torch.arange(n))


def check_events_and_bytes(dev: torch.device) -> list[Result]:
    registry = CollectorRegistry()
    loader = instrument.DataLoader(dataset(BATCHES), batch_size=BATCH, pin_memory=True,
                                   name="events", registry=registry)
    for t in next(iter(DataLoader(dataset(1), batch_size=BATCH, pin_memory=True))):
        t.to(dev, non_blocking=True)  # allocator warm-up, outside both measurements
    torch.cuda.synchronize()
    refs: list[tuple[Event, Event]] = []
    nbytes, pinned, kept = 0, True, None
    for batch in loader:
        pinned = pinned and all(t.is_pinned() for t in batch)
        out = loader.to_device(batch, dev, non_blocking=True)
        start, end = Event(enable_timing=True), Event(enable_timing=True)
        start.record()
        _ = [t.to(dev, non_blocking=True) for t in batch]
        end.record()
        refs.append((start, end))
        nbytes += sum(t.nbytes for t in batch)
        kept = kept or (batch, out)
    rec = getattr(getattr(loader, "_instruments", None), "rec", None)  # private: informational only
    pending = len(rec.pending_events) if rec is not None else None
    torch.cuda.synchronize()
    assert kept is not None
    same = all(torch.equal(a, b.cpu()) for a, b in zip(kept[0], kept[1], strict=True))
    phase = labels("events", phase=cat.PHASE_TRANSFER)
    count = registry.get_sample_value(f"{cat.TIME.name}_count", phase)  # collect() flushes
    total = registry.get_sample_value(f"{cat.TIME.name}_sum", phase) or 0.0
    ref = sum(s.elapsed_time(e) for s, e in refs) / 1e3
    ratio = total / ref if ref > 0 else 0.0
    events_ok = (pinned and same and count == BATCHES and pending in (None, BATCHES)
                 and 1 / SANE_FACTOR <= ratio <= SANE_FACTOR)
    moved = registry.get_sample_value(cat.TRANSFER_BYTES.name, labels("events"))
    one = registry.get_sample_value(cat.BATCH_BYTES.name, labels("events"))
    want_one = sum(t.nbytes for t in kept[0])
    return [
        ("PASS" if events_ok else "FAIL", "events", {
            "transfers": BATCHES, "histogram_count": count, "pending_before_sync": pending,
            "histogram_sum_s": total, "reference_sum_s": ref, "ratio": ratio,
            "pinned": pinned, "values_equal": same}),
        ("PASS" if moved == nbytes and one == want_one else "FAIL", "bytes", {
            "transfer_bytes_total": moved, "expected": nbytes, "batch_bytes": one,
            "expected_batch_bytes": want_one}),
    ]


@contextlib.contextmanager
def syncs_counted() -> Iterator[tuple[list[str], list[str]]]:
    """Explicit synchronize calls, and torch's sync-debug warnings about implicit ones."""
    found: list[str] = []
    implicit: list[str] = []
    targets = [(torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
               (torch.cuda.Stream, "synchronize")]
    saved = [(obj, name, getattr(obj, name)) for obj, name in targets]

    def counting(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            found.append(label)
            return fn(*args, **kwargs)
        return counted

    for obj, name, fn in saved:
        setattr(obj, name, counting(f"{getattr(obj, '__name__', obj)}.{name}", fn))
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield found, implicit
        implicit += [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    finally:
        torch.cuda.set_sync_debug_mode(mode)
        for obj, name, fn in saved:
            setattr(obj, name, fn)


def gpu_work(dev: torch.device) -> Callable[[torch.Tensor, float], None]:
    """Launches about `seconds` of matmuls that read x (so they wait for its copy)."""
    a = torch.rand(2048, 2048, device=dev)
    c = torch.empty_like(a)
    torch.mm(a, a, out=c)
    start, end = Event(enable_timing=True), Event(enable_timing=True)
    start.record()
    for _ in range(20):
        torch.mm(a, a, out=c)
    end.record()
    end.synchronize()
    per_mm = start.elapsed_time(end) / 1e3 / 20

    def work(x: torch.Tensor, seconds: float) -> None:
        c.add_(x.sum())
        for _ in range(max(1, round(seconds / per_mm))):
            torch.mm(a, a, out=c)
    return work


def spin(seconds: float) -> None:
    end = perf_counter() + seconds
    while perf_counter() < end:
        pass


def check_overlap(dev: torch.device, batches: int = 60, rounds: int = 3) -> Result:
    ds = dataset(batches, width=4096)  # 1 MiB batches: little host time in the loader
    plain = DataLoader(ds, batch_size=BATCH, pin_memory=True)
    inst = instrument.DataLoader(ds, batch_size=BATCH, pin_memory=True, name="overlap",
                                 registry=CollectorRegistry())
    work = gpu_work(dev)

    def plain_move(b: Any) -> Any:
        return [t.to(dev, non_blocking=True) for t in b]

    def synced_move(b: Any) -> Any:
        out = plain_move(b)
        torch.cuda.synchronize()
        return out

    variants: dict[str, tuple[Any, Callable[[Any], Any]]] = {
        "plain": (plain, plain_move),
        "instrumented": (inst, lambda b: inst.to_device(b, dev, non_blocking=True)),
        "synced_control": (plain, synced_move),
    }

    def run(name: str) -> tuple[float, tuple[list[str], list[str]]]:
        loader, move = variants[name]
        torch.cuda.synchronize()
        t0 = perf_counter()
        with syncs_counted() as found:
            for i, batch in enumerate(loader):
                x = move(batch)[0]
                work(x, HEAVY_S if i % 2 else LIGHT_S)
                spin(LIGHT_S if i % 2 else HEAVY_S)
        torch.cuda.synchronize()  # after the loop, not in it
        return perf_counter() - t0, found

    for name in variants:  # warm-up: pinned-memory pool, kernels
        run(name)
    walls: dict[str, list[float]] = {name: [] for name in variants}
    syncs: dict[str, tuple[list[str], list[str]]] = {}
    for r in range(rounds):
        names = list(variants)[r % 3:] + list(variants)[:r % 3]
        for name in names:
            seconds, syncs[name] = run(name)
            walls[name].append(seconds)
    wall = {name: statistics.median(w) for name, w in walls.items()}
    ratio = wall["instrumented"] / wall["plain"]
    control = wall["synced_control"] / wall["plain"]
    (calls, implicit), (_, plain_implicit) = syncs["instrumented"], syncs["plain"]
    ok = (ratio <= MAX_OVERLAP_RATIO < control  # the control shows the test can see a sync
          and not calls and len(implicit) <= len(plain_implicit)
          and len(syncs["synced_control"][0]) >= batches)  # the counter sees the control's
    return ("PASS" if ok else "FAIL", "overlap", {
        "wall_s": wall, "instrumented_ratio": ratio, "control_ratio": control,
        "synchronize_calls": calls[:5], "implicit_syncs": implicit[:5],
        "implicit_syncs_plain": len(plain_implicit),
        "control_synchronize_calls": len(syncs["synced_control"][0])})


def check_nvml(nvml: Any = None, deadline_s: float = 10.0) -> Result:
    try:
        from dataloader_exporter.exporter.collectors.gpu_nvml import GpuCollector
    except ImportError as e:
        return "SKIP", "nvml", {"reason": f"no exporter.collectors.gpu_nvml ({e})"}
    try:
        collector = GpuCollector(nvml=nvml, call_timeout=10.0)  # the first nvmlInit can be slow
    except TypeError:
        collector = GpuCollector(nvml=nvml)
    registry = CollectorRegistry()
    registry.register(collector)
    deadline = time.monotonic() + deadline_s
    while True:  # one scrape, repeated only while it finds nothing (a slow first nvmlInit)
        samples = [s for family in registry.collect() for s in family.samples]
        if samples or getattr(collector, "up", False) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    gpus: dict[str, dict[str, Any]] = {}
    for s in samples:
        if s.name == cat.GPU_INFO.name:
            gpus[s.labels["gpu"]] = {"uuid": s.labels["gpu_uuid"], "name": s.labels.get("name")}
    shown = (cat.GPU_UTILIZATION, cat.GPU_MEMORY_USED, cat.GPU_MEMORY_TOTAL,
             cat.GPU_TEMPERATURE, cat.GPU_POWER)
    for s in samples:
        if s.name in {m.name for m in shown} and s.labels.get("gpu") in gpus:
            gpus[s.labels["gpu"]][s.name] = s.value
    up = getattr(collector, "up", None)
    with contextlib.suppress(Exception):
        collector.close()
    ok = up is True and bool(gpus) and all(
        cat.GPU_UTILIZATION.name in g and cat.GPU_MEMORY_USED.name in g for g in gpus.values())
    return "PASS" if ok else "FAIL", "nvml", {
        "collector_up": up, "errors": getattr(collector, "errors", None), "gpus": gpus,
        "torch_device_count": torch.cuda.device_count()}


def check_gpu_uuid(dev: torch.device) -> Result:
    registry = CollectorRegistry()
    loader = instrument.DataLoader(dataset(1, 8), batch_size=BATCH, name="uuid",
                                   registry=registry)
    for batch in loader:
        loader.to_device(batch, dev)
    for _ in loader:  # the next epoch's dataloader_info carries it too
        pass
    seen = [s.labels.get("gpu_uuid", "") for f in registry.collect() for s in f.samples
            if s.name == cat.INFO.name]
    nvml_uuids: list[str] = []
    with contextlib.suppress(Exception):
        import pynvml

        pynvml.nvmlInit()
        for i in range(pynvml.nvmlDeviceGetCount()):
            u = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
            nvml_uuids.append(u.decode() if isinstance(u, bytes) else str(u))
    ok = len(seen) == 1 and seen[0] != "" and seen[0] in nvml_uuids
    return "PASS" if ok else "FAIL", "uuid", {"dataloader_info": seen, "nvml": nvml_uuids}


def guarded(name: str, check: Callable[[], list[Result]]) -> list[Result]:
    """A check that raises fails alone; the others still run."""
    try:
        return check()
    except Exception as e:
        return [("FAIL", name, {"error": repr(e)})]


def main() -> int:
    # config lines and advice
    logging.getLogger("dataloader_exporter.instrument").setLevel(logging.ERROR)
    os.environ.pop(ENV_DIR, None)  # no snapshot thread of our own: registries are local
    if not torch.cuda.is_available():
        print(f"SKIP: no CUDA (torch {torch.__version__}, CUDA build {torch.version.cuda})")
        print(json.dumps({"skipped": "no CUDA", "torch": torch.__version__}))
        return 0
    dev = torch.device("cuda", torch.cuda.current_device())
    t0 = perf_counter()
    results = [*guarded("events", lambda: check_events_and_bytes(dev)),
               *guarded("overlap", lambda: [check_overlap(dev)]),
               *guarded("nvml", lambda: [check_nvml()]),
               *guarded("uuid", lambda: [check_gpu_uuid(dev)])]
    for status, name, details in results:
        print(f"{status}  {name}: {json.dumps(details, sort_keys=True, default=str)}")
    summary = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
               "seconds": round(perf_counter() - t0, 1),
               "checks": {name: status for status, name, _ in results},
               "details": {name: details for _, name, details in results}}
    print(json.dumps(summary, sort_keys=True, default=str))
    return 1 if any(status == "FAIL" for status, _, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main())
