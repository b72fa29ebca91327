"""Where the loader runs: its rank (machine facts live in core.facts)."""

from __future__ import annotations

import os


def current_rank() -> str:
    """torch.distributed's rank when initialised, else $RANK, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return str(dist.get_rank())
    except Exception:
        pass
    rank = os.environ.get("RANK", "").strip()
    return rank if rank.isdigit() else "0"


def local_world_size() -> int:
    """Ranks on this machine: torchrun's $LOCAL_WORLD_SIZE, else 1."""
    size = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(size) if size.isdigit() and int(size) > 0 else 1


def local_rank() -> int | None:
    """This process's rank on its machine ($LOCAL_RANK under torchrun), None elsewhere."""
    rank = os.environ.get("LOCAL_RANK", "").strip()
    return int(rank) if rank.isdigit() else None


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
