"""Names for loaders nobody named: framework roles, and the place in the code that built them.

Zero-code mode names a loader once, when it is built (zerocode.py decides which rule
applies). The rules here read only the calling stack, so a name is the same on every rank
and every restart of the same code:

- role_from_stack: the role of the nearest framework method building it (ROLES:
  Lightning's train_dataloader, the HF Trainer's get_eval_dataloader, ...);
- site_name: where the user's code built it, as ``FILE:LINE`` of the innermost frame
  outside Python's own library, installed packages, torch and this project (``train.py:42``
  for a loader built at line 42 of train.py, also when it is built inside webdataset's
  WebLoader or torchdata called from that line). Two loaders built at one line from
  different call chains (a helper that builds every loader, called from two places) are
  told apart by the caller's site, joined with ``-``: the first keeps ``data.py:10``, the
  next is ``data.py:10-train.py:31``. A loader built again by the same chain (each epoch,
  say) keeps its name.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import threading
from functools import cache
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
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")  # what a loader name may hold (loadersettings)
_OWN = ("instrument", "exporter", "dataloader_exporter", "diagnosis", "dashboards", "torch")


def _frames(depth: int) -> list[FrameType]:
    frame: FrameType | None = sys._getframe(2)
    out: list[FrameType] = []
    while frame is not None and len(out) < depth:
        out.append(frame)
        frame = frame.f_back
    return out


def built_by_framework(depth: int = STACK_DEPTH) -> bool:
    """Whether code of one of FRAMEWORKS is on the calling stack."""
    for frame in _frames(depth):
        module = frame.f_globals.get("__name__", "")
        if isinstance(module, str) and module.split(".", 1)[0] in FRAMEWORKS:
            return True
    return False


def role_from_stack(depth: int = STACK_DEPTH) -> str | None:
    """The role (ROLES) of the nearest framework method on the calling stack, or None."""
    for frame in _frames(depth):
        role = ROLES.get(frame.f_code.co_name)
        if role is not None:
            return role
    return None


@cache
def _library_dirs() -> tuple[str, ...]:
    """Directories whose code is not the user's: the standard library, installed
    packages, and this project's and torch's packages wherever they live."""
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    for name in _OWN:
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if file:
            dirs.add(os.path.dirname(file))
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs if d)


def _is_user_file(filename: str) -> bool:
    if not filename or filename.startswith("<frozen"):
        return False
    if filename.startswith("<"):
        return True  # python -c, an interactive prompt: the user's own code
    path = os.path.realpath(filename)
    if os.sep + "site-packages" + os.sep in path or os.sep + "dist-packages" + os.sep in path:
        return False
    return not path.startswith(_library_dirs())


def user_stack(depth: int = STACK_DEPTH) -> tuple[tuple[str, int], ...]:
    """(file, line) of each frame of the user's code on the calling stack, innermost first."""
    return tuple((f.f_code.co_filename, f.f_lineno) for f in _frames(depth)
                 if _is_user_file(f.f_code.co_filename))


def _site(filename: str, line: int) -> str:
    base = os.path.basename(filename.strip("<>")) or "code"
    return _UNSAFE.sub("_", f"{base}:{line}")


class SiteNames:
    """Names from the places in the code that built loaders (the module docstring)."""

    def __init__(self) -> None:
        self._owners: dict[str, tuple[tuple[str, int], ...]] = {}
        self._lock = threading.Lock()

    def name(self, stack: tuple[tuple[str, int], ...]) -> str | None:
        """The name for a loader built by this user stack; None when there is none."""
        if not stack:
            return None
        with self._lock:
            parts: list[str] = []
            for filename, line in stack:
                parts.append(_site(filename, line))
                candidate = "-".join(parts)
                owner = self._owners.setdefault(candidate, stack)
                if owner == stack:
                    return candidate
            n = 2  # the same sites all the way up, yet another stack: number it
            while self._owners.setdefault(f"{candidate}-{n}", stack) != stack:
                n += 1
            return f"{candidate}-{n}"


def class_name(obj: object) -> str:
    """A label-safe name from an object's class (when no site can be found)."""
    return _UNSAFE.sub("_", type(obj).__name__)[:64] or "dataset"
