"""Where the loader runs: its rank (machine facts live in core.facts)."""

from __future__ import annotations

import os
import sys

from dataloader_exporter.core.envnames import getenv


def current_rank() -> str:
    """torch.distributed's rank when initialised, else $RANK, else 0."""
    dist = sys.modules.get("torch.distributed")  # not imported: not initialised either
    try:  # a torch built without it has no is_initialized (is_available() is False)
        if dist is not None and dist.is_initialized():
            return str(dist.get_rank())
    except Exception:
        pass
    rank = getenv("RANK").strip()
    return rank if rank.isdigit() else "0"


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def local_world_size() -> int:
    """Ranks on this machine: torchrun's $LOCAL_WORLD_SIZE (or Open MPI's
    $OMPI_COMM_WORLD_LOCAL_SIZE); else $WORLD_SIZE when every rank meets at a loopback
    $MASTER_ADDR (a launcher that starts its ranks on one machine and says only the world
    size, as Lightning's own DDP launcher does); else 1."""
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        size = os.environ.get(name, "").strip()
        if size.isdigit() and int(size) > 0:
            return int(size)
    world = os.environ.get("WORLD_SIZE", "").strip()
    if world.isdigit() and int(world) > 0 and os.environ.get("MASTER_ADDR", "") in LOOPBACK:
        return int(world)
    return 1


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
