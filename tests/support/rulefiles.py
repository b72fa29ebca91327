"""The generated Prometheus rule files and their promtool tests, written for promtool."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from dataloader_exporter.dashboards import build

FILES = build.files()


def write_rule_file(tmp_path: Path, stem: str, rules: dict[str, Any] | None = None) -> Path:
    """prometheus/<stem>.yml as generated (or `rules`) and its tests in tmp_path; returns
    the tests' path."""
    (tmp_path / f"{stem}.yml").write_text(
        FILES[f"prometheus/{stem}.yml"] if rules is None else build.to_yaml(rules))
    tests = tmp_path / f"{stem}.test.yml"
    tests.write_text(FILES[f"prometheus/{stem}.test.yml"])
    return tests


def promtool_run(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=120)
