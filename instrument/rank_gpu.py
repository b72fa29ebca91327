"""Which GPU a rank uses, named as NVML and dcgm-exporter name it (its UUID).

CUDA device indexes are renumbered by CUDA_VISIBLE_DEVICES (every rank of a torchrun
job may call its GPU cuda:0), so the UUID is the only name that joins a rank's series
with the exporter's gpu_* series and dcgm-exporter's. Read once per loader, through the
public torch.cuda.get_device_properties.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def gpu_uuid(device: torch.device,
             properties: Callable[[torch.device], Any] = torch.cuda.get_device_properties
             ) -> str:
    """'GPU-<uuid>' (or a MIG instance's 'MIG-<uuid>') of a CUDA device; '' when unknown."""
    try:
        text = str(getattr(properties(device), "uuid", "") or "").strip()
    except Exception:  # no driver, a device torch cannot query: unknown, not an error
        return ""
    if not text:
        return ""
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
