"""Names for loaders nobody named: framework roles, and the place in the code that built them.

Zero-code mode names a loader once, when it is built (zerocode/hooks.py decides which rule
applies). The rules here read only the calling stack, never what was built before, so a
name is the same on every rank and every restart of the same code:

- role_from_stack: the role of the nearest framework method building it (ROLES:
  Lightning's train_dataloader, the HF Trainer's get_eval_dataloader, ...);
- site_name: where the code built it, ``FILE:LINE`` of the innermost frame that is not
  Python's standard library, torch, a data library or framework (LIBRARIES) or this
  project, so a loader that webdataset's WebLoader or torchdata builds is named by the
  line that called it. When that frame is inside a function, its caller's site follows,
  joined with ``-``: a helper that builds loaders for two callers gives two names
  (``data.py:10-train.py:31`` and ``data.py:10-train.py:32``), while a loader built at
  a script's top level is just ``train.py:42``. Loaders built by one line from one
  caller (a loop, or a comprehension over the splits) share a name.
"""

from __future__ import annotations

import os
import re
import sys
from types import FrameType

# The framework methods that build loaders, and the name their loaders get.
ROLES: dict[str, str] = {
    "train_dataloader": "train", "get_train_dataloader": "train",
    "val_dataloader": "eval", "get_eval_dataloader": "eval", "eval_dataloader": "eval",
    "test_dataloader": "test", "get_test_dataloader": "test",
    "predict_dataloader": "predict",
}
STACK_DEPTH = 64  # frames searched, once per loader built
# Packages whose loaders are copies of the user's when built over an adopted loader's dataset.
FRAMEWORKS = ("accelerate", "lightning", "lightning_fabric", "pytorch_lightning",
              "transformers")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")  # what a loader name may hold (core.settings)


def _frames(depth: int) -> list[FrameType]:
    frame: FrameType | None = sys._getframe(2)
    out: list[FrameType] = []
    while frame is not None and len(out) < depth:
        out.append(frame)
        frame = frame.f_back
    return out


def stack(depth: int = STACK_DEPTH) -> list[FrameType]:
    """The calling stack (the caller's frame first, at most depth frames): walked once,
    for the functions below (frames=) to read."""
    return _frames(depth)


def built_by_framework(depth: int = STACK_DEPTH, frames: list[FrameType] | None = None
                       ) -> bool:
    """Whether code of one of FRAMEWORKS is on the calling stack (or in frames)."""
    for frame in _frames(depth) if frames is None else frames:
        module = frame.f_globals.get("__name__", "")
        if isinstance(module, str) and module.split(".", 1)[0] in FRAMEWORKS:
            return True
    return False


def role_from_stack(depth: int = STACK_DEPTH, frames: list[FrameType] | None = None
                    ) -> str | None:
    """The role (ROLES) of the nearest framework method on the calling stack (or in
    frames), or None."""
    for frame in _frames(depth) if frames is None else frames:
        role = ROLES.get(frame.f_code.co_name)
        if role is not None:
            return role
    return None


# Top-level packages whose frames are never the place a loader was built, beside the
# standard library: torch, the data libraries and frameworks that build loaders for their
# callers, test runners, and this project.
LIBRARIES = frozenset({
    "torch", "torchdata", "webdataset", "datasets", "litdata", "streaming", "timm",
    "lightning", "lightning_fabric", "pytorch_lightning", "accelerate", "transformers",
    "dataloader_exporter",
    "_pytest", "pytest", "pluggy", "runpy", "importlib"}) | frozenset(sys.stdlib_module_names)


def _is_library(frame: FrameType) -> bool:
    module = frame.f_globals.get("__name__")
    if not isinstance(module, str):
        return True
    return module.split(".", 1)[0] in LIBRARIES or frame.f_code.co_filename.startswith(
        "<frozen")


def _site(frame: FrameType) -> str:
    base = os.path.basename(frame.f_code.co_filename.strip("<>")) or "code"
    return _UNSAFE.sub("_", f"{base}:{frame.f_lineno}")


def site_name(depth: int = STACK_DEPTH, frames: list[FrameType] | None = None) -> str | None:
    """The name of a loader built by the calling code (or by frames: see stack()), as the
    module docstring says; None when every frame is a library's."""
    frames = [f for f in (_frames(depth) if frames is None else frames) if not _is_library(f)]
    if not frames:
        return None
    name = _site(frames[0])
    if frames[0].f_code.co_name != "<module>" and len(frames) > 1:
        name += "-" + _site(frames[1])
    return name


def class_name(obj: object) -> str:
    """A label-safe name from an object's class (when no site can be found)."""
    return _UNSAFE.sub("_", type(obj).__name__)[:64] or "dataset"
