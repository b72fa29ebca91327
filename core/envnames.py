"""The environment variables both sides read, and the exporter's port, named once. The
sidecar's flags each have one too: ENV_PREFIX + the flag's name in capitals (the flag
table of exporter/config.py)."""

from __future__ import annotations

import os
import sys

DEFAULT_PORT = 9478  # the exporter's, in-process or sidecar (the image EXPOSEs it)

ENV_PREFIX = "DATALOADER_EXPORTER_"
ENV_DIR = ENV_PREFIX + "DIR"  # the snapshot directory the trainer writes, the sidecar reads
ENV_SETTINGS = ENV_PREFIX + "SETTINGS"  # loader settings applied at construction
ENV_AUTO = ENV_PREFIX + "AUTO"  # zero-code mode: instrument every DataLoader of a process
ENV_SERIES = ENV_PREFIX + "SERIES"  # the trainer's series per loader and rank: full or job
ENV_PURE_PYTHON = ENV_PREFIX + "PURE_PYTHON"  # the loader's per-batch path in Python, not C


def pure_python_asked() -> bool:
    """Whether ENV_PURE_PYTHON asks for the per-batch path in Python (set, and not 0)."""
    return getenv(ENV_PURE_PYTHON) not in ("", "0")


_POSIX = os.name == "posix"  # where os.environ keeps its own table (_data): bytes names
_FS = sys.getfilesystemencoding()  # and values, kept in step with each change through it


def getenv(name: str, default: str = "") -> str:
    """os.environ.get(name, default), read from os.environ's own table where it has one.

    os.environ.get runs three Python functions and, for a name that is not set, raises and
    catches a KeyError: about 20 written pages that a forked worker shares. The instrumented
    loader reads a few names at each build and iter(), which a loader rebuilt every epoch
    pays every epoch.
    """
    table = getattr(os.environ, "_data", None) if _POSIX else None  # os.environ now: a
    if type(table) is not dict:  # test may have put another mapping in its place
        return os.environ.get(name, default)
    value = table.get(name.encode(_FS, "surrogateescape"))
    return default if value is None else value.decode(_FS, "surrogateescape")
