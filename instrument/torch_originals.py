"""torch's own DataLoader methods, as they were before zero-code mode's hooks, and the marks
the hooks go by: what zerocode/hooks.py shares with the code they call (iter_start.py) and
with instrument.DataLoader (loader.py), so that neither side imports the other."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.utils.data

# The attribute of a hook that holds the function it replaced.
MARK = "__dataloader_exporter_original__"
# A class attribute of loaders that time themselves (instrument.DataLoader): not hooked.
SELF_TIMED = "_dataloader_exporter_times_itself"


def original(attr: str) -> Any:
    """torch's DataLoader.<attr>, without the hook that may have replaced it."""
    f = vars(torch.utils.data.DataLoader)[attr]
    return getattr(f, MARK, f)


TORCH_INIT: Callable[..., None] = original("__init__")
TORCH_ITER: Callable[[Any], Any] = original("__iter__")


def self_timed(obj: Any) -> bool:
    """Whether obj is a loader that times itself (an instrument.DataLoader)."""
    return bool(getattr(type(obj), SELF_TIMED, False))


_lazy: set[Callable[[Any], Any]] = set()  # subclass __iter__s that return generators


def lazy(iter_function: Callable[[Any], Any]) -> None:
    """A subclass's __iter__ returned a generator: torch's runs later, and measures."""
    _lazy.add(iter_function)


def is_lazy(iter_function: Callable[[Any], Any]) -> bool:
    return iter_function in _lazy
