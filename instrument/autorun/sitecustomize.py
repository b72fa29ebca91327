"""Zero-code mode, in every Python process that has this directory on its path.

`dataloader-exporter run -- COMMAND` puts this directory first on PYTHONPATH and sets
DATALOADER_EXPORTER_AUTO=1; an image whose entrypoint you cannot change sets the same two
variables (`dataloader-exporter run --print-env` prints them). Python imports this module
at start-up, in the command and in every Python process it starts (torchrun's ranks,
Lightning's DDP processes, `accelerate launch`), since they inherit the environment.

Start-up costs only stdlib imports: a settings line is checked at once (a bad one is an
error before anything runs), and the DataLoader hook (instrument/zerocode/hooks.py) is
installed right after `torch` has been imported, never in a process that does not import
torch. Then the next sitecustomize on the path (a distribution's or your own) runs, as it
would without this one.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from typing import Any

ENV_AUTO = "DATALOADER_EXPORTER_AUTO"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _say(msg: str) -> None:
    sys.stderr.write(f"dataloader-exporter: {msg}\n")
    sys.stderr.flush()


def _check_settings() -> None:
    line = os.environ.get("DATALOADER_EXPORTER_SETTINGS", "")
    if not line.strip():
        return
    try:
        from dataloader_exporter.core.settings import SettingsError, parse
    except ImportError as e:
        _say(f"zero-code mode is off in this process ({e})")
        return
    try:
        parse(line)
    except SettingsError as e:
        _say(str(e))
        os._exit(2)  # before the program does anything, in every process alike


def _torch_ready() -> None:
    try:
        from dataloader_exporter.instrument.zerocode import hooks as zerocode_hooks

        zerocode_hooks.install(auto=True)
    except Exception as e:  # the program runs as without us
        _say(f"zero-code mode is off in this process: {e!r}")


class _Loader(importlib.abc.Loader):
    """torch's own loader; installs the hook once torch's module has run."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        for finder in [f for f in sys.meta_path if isinstance(f, _WhenTorchImported)]:
            sys.meta_path.remove(finder)  # torch has run: nothing more to watch for
        _torch_ready()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _WhenTorchImported(importlib.abc.MetaPathFinder):
    """Watches for torch's import. It stays on sys.meta_path until torch's module has
    run: a mere lookup (importlib.util.find_spec("torch"), as transformers does at import
    to see whether torch is there) must not use it up."""

    def __init__(self) -> None:
        self._looking = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch" or self._looking:
            return None
        self._looking = True  # our own lookup below goes to the other finders
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._looking = False
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def _chain() -> None:
    """Runs the sitecustomize this one hides, if any."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if os.environ.get(ENV_AUTO, "").strip().lower() in ("1", "true", "yes", "on"):
    _check_settings()
    if "torch" in sys.modules:  # imported by an earlier start-up hook
        _torch_ready()
    else:
        sys.meta_path.insert(0, _WhenTorchImported())
_chain()
