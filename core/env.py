"""The environment variables both sides read, named once. The sidecar's flags each have
one too: ENV_PREFIX + the flag's name in capitals (exporter/config.py's table)."""

from __future__ import annotations

ENV_PREFIX = "DATALOADER_EXPORTER_"
ENV_DIR = ENV_PREFIX + "DIR"  # the snapshot directory the trainer writes, the sidecar reads
ENV_SETTINGS = ENV_PREFIX + "SETTINGS"  # loader settings applied at construction
ENV_AUTO = ENV_PREFIX + "AUTO"  # zero-code mode: instrument every DataLoader of a process
