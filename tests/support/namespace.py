"""tools/namespace.py for the tests: the namespace's modules where the checkout holds
them (each file and the dotted name it is installed under)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "tools" / "namespace.py"
_spec = importlib.util.spec_from_file_location("dataloader_exporter_tools_namespace", _PATH)
assert _spec is not None and _spec.loader is not None
_module = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _module
_spec.loader.exec_module(_module)

NS: str = _module.NS
ROOTS: tuple[str, ...] = _module.ROOTS
REPO: Path = _module.REPO
folder = _module.folder
module_name = _module.module_name
files = _module.files
all_files = _module.all_files
