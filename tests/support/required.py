"""Binaries and modules a test needs: skipped where they are missing, except in CI, where
a missing one is a failure (`make test` installs them)."""

from __future__ import annotations

import importlib
import os
import shutil
from typing import Any

import pytest

IN_CI = os.environ.get("CI") == "true"


def require_binary(name: str,
                   where: str = "Debian package prometheus; `make test` installs it") -> str:
    """Path of a binary the test needs: skipped locally when missing, a failure in CI."""
    path = shutil.which(name)
    if path is None:
        msg = f"{name} not installed ({where})"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def require_module(name: str) -> Any:
    """A framework the test runs: skipped locally when missing, a failure in CI (`make test`
    installs the `frameworks` extra)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        msg = f"{name} not installed (the `frameworks` extra; `make test` installs it)"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)
