"""Holders: objects that are not DataLoaders but iterate one and re-chunk its batches.

A holder (HOLDERS: webdataset's WebLoader, whose ``.unbatched().batched(n)`` makes the
batches the loop takes) is measured where the loop iterates it: its torch loader then
only reports its workers and settings ("held", quietly), so batches are counted once, as
the loop saw them. wrap() of a holder does the same, and keeps measuring through its
chain methods. How a holder's iteration is hooked: hooks.py.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch.utils.data

# Classes (module.qualname) that hold a torch DataLoader in `pipeline` and re-chunk its
# batches before the loop takes them.
HOLDERS = frozenset({"webdataset.compat.WebLoader"})
_PACKAGES = frozenset(h.split(".", 1)[0] for h in HOLDERS)
_TorchDataLoader = torch.utils.data.DataLoader
STACK_DEPTH = 16  # frames searched for a holder's __init__ when a loader is built


def is_holder(obj: Any) -> bool:
    """Whether obj is of a HOLDERS class, or of a subclass of one."""
    return any(f"{k.__module__}.{k.__qualname__}" in HOLDERS for k in type(obj).__mro__)


def held_loaders(obj: Any) -> list[Any]:
    """The torch DataLoaders a holder iterates (its `pipeline`); [] for anything else."""
    if not is_holder(obj):
        return []
    pipeline = getattr(obj, "pipeline", None)
    if not isinstance(pipeline, list):
        return []
    return [s for s in pipeline if isinstance(s, _TorchDataLoader)]


def rechunks(holder: Any, inner: list[Any]) -> bool:
    """Whether the holder's pipeline does more than iterate its torch loaders: its batches
    are then counted as a loader timed from the outside counts them."""
    return len(getattr(holder, "pipeline", ())) > len(inner)


def holder_on_stack() -> Any:
    """The holder whose __init__ is building a loader right now, if any (none while no
    package of HOLDERS is imported)."""
    if not any(map(sys.modules.__contains__, _PACKAGES)):
        return None
    frame = inspect.currentframe()
    for _ in range(STACK_DEPTH):
        if frame is None:
            return None
        if frame.f_code.co_name == "__init__":
            obj = frame.f_locals.get("self")
            if obj is not None and not isinstance(obj, _TorchDataLoader) and is_holder(obj):
                return obj
        frame = frame.f_back
    return None
