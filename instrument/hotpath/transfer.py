"""The per-batch code of a timed transfer: to_device() of an instrumented loader.

On CUDA the copy is bracketed by CUDA events that the recorder reads later, once they
have completed (never a synchronize in the loop), so non_blocking copies still overlap
compute; elsewhere the host time of the copy is measured. Either way the bytes that
changed device are counted.
"""

from __future__ import annotations

from time import perf_counter_ns
from typing import Any, Protocol

import torch

from ..preflight import LoaderConfig, Preflight
from ..rank_gpu import gpu_uuid
from .batch import move
from .recorder import LoaderRecorder

MAX_PENDING_EVENTS = 4096  # CUDA event pairs kept waiting before the oldest are dropped


class Transferring(Protocol):
    """What a timed transfer needs of a loader's Instruments."""

    gpu_checked: bool
    preflight: Preflight
    config: LoaderConfig

    @property
    def rec(self) -> LoaderRecorder: ...

    def note_gpu(self, uuid: str) -> None: ...


def timed_to_device(self: Transferring, batch: Any, device: Any, non_blocking: bool) -> Any:
    """Instruments.to_device: the batch moved to `device`, its transfer recorded."""
    rec = self.rec
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if not self.gpu_checked:  # once: which GPU this rank feeds, for dataloader_info
            self.gpu_checked = True
            self.note_gpu(gpu_uuid(dev))
        self.preflight.on_cuda_transfer(self.config)
        stream = torch.cuda.current_stream(dev)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        out, nbytes = move(batch, dev, non_blocking)
        end.record(stream)
        if len(rec.pending_events) >= MAX_PENDING_EVENTS:
            rec.pending_events.popleft()
        rec.pending_events.append((start, end))
    else:
        t0 = perf_counter_ns()
        out, nbytes = move(batch, dev, non_blocking)
        rec.transfer.append(perf_counter_ns() - t0)
    rec.transfer_bytes += nbytes
    return out
