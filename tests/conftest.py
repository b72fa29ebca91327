"""Shared fixtures: fresh registries, promtool and Prometheus binaries."""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from procs import REPO, Prometheus
from prometheus_client import CollectorRegistry

IN_CI = os.environ.get("CI") == "true"


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    """A registry of the test's own; its hub's snapshot threads and servers are stopped
    after the test, so that they do not load the machine for every later test."""
    reg = CollectorRegistry()
    yield reg
    # none without the instrumentation imported
    hub = sys.modules.get("dataloader_exporter.instrument.hub")
    if hub is not None:
        hub.hub_for(reg).close()


def require_binary(name: str) -> str:
    """Path of a binary the test needs: skipped locally when missing, a failure in CI."""
    path = shutil.which(name)
    if path is None:
        msg = f"{name} not installed (Debian package prometheus; `make test` installs it)"
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


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_binary("promtool")


@pytest.fixture(scope="session")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """One real Prometheus for the whole session, evaluating the committed recording rules
    every second; tests add file_sd targets to it."""
    server = Prometheus(require_binary("prometheus"), tmp_path_factory.mktemp("prometheus"),
                        rule_files=[str(REPO / "deploy" / "prometheus" / "recording.yml")])
    yield server
    server.stop()
