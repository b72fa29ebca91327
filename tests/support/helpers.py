"""Scrape, parse and wait helpers shared by the tests. No torch here: the modules not
marked torch import this one; the datasets are in torch_helpers.py."""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    """A sample's value by catalogue name and labels (default loader/rank labels)."""
    return registry.get_sample_value(name, labels)


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Exposition text -> {(sample name, sorted labels): value}."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return parse(generate_latest(registry).decode())


_clock = itertools.count(10**9, 10)  # an injected clock: each check 10 s after the last


def refreshes(loader: Any, n: int = 3) -> None:
    """n worker-liveness checks of an instrumented loader, each past the one-second
    interval, so that a worker seen dead would be counted."""
    for _ in range(n):
        loader._instruments.rec.flush(now=float(next(_clock)))


def wait_for_write(writer: Any, timeout: float = 5.0) -> bool:
    """Blocks until a SnapshotWriter completes a write begun after this call (one under
    way took its figures before: it does not count) and says whether it wrote."""
    written = writer.writes
    if not writer.wait_for(writer.ask(), timeout):
        return False
    return bool(writer.writes > written)


def deadline_poll(check: Any, timeout: float, interval: float = 0.05) -> Any:
    """Calls check() until it returns a truthy value or the deadline passes."""
    end = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > end:
            return result
        time.sleep(interval)


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` (root only; the test skips elsewhere)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True).returncode != 0:
        pytest.skip("needs root and mount to make a small filesystem")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
