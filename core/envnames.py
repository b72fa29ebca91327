"""The environment variables both sides read, and the exporter's port, named once. The
sidecar's flags each have one too: ENV_PREFIX + the flag's name in capitals (the flag
table of exporter/config.py)."""

from __future__ import annotations

import os

DEFAULT_PORT = 9478  # the exporter's, in-process or sidecar (the image EXPOSEs it)

ENV_PREFIX = "DATALOADER_EXPORTER_"
ENV_DIR = ENV_PREFIX + "DIR"  # the snapshot directory the trainer writes, the sidecar reads
ENV_SETTINGS = ENV_PREFIX + "SETTINGS"  # loader settings applied at construction
ENV_AUTO = ENV_PREFIX + "AUTO"  # zero-code mode: instrument every DataLoader of a process
ENV_SERIES = ENV_PREFIX + "SERIES"  # the trainer's series per loader and rank: full or job
ENV_PURE_PYTHON = ENV_PREFIX + "PURE_PYTHON"  # the loader's per-batch path in Python, not C


def pure_python_asked() -> bool:
    """Whether ENV_PURE_PYTHON asks for the per-batch path in Python (set, and not 0)."""
    return os.environ.get(ENV_PURE_PYTHON, "") not in ("", "0")
