"""The benchmarks and the prepared GPU check still start: a moved import once broke them
silently (no test ran them, and mypy does not read bench/)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from procs import REPO


@pytest.mark.parametrize("script", ["overhead.py", "scrape.py", "proc_sampling.py"])
def test_each_benchmark_starts_and_explains_itself(script: str) -> None:
    result = subprocess.run([sys.executable, str(REPO / "bench" / script), "--help"],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "--quick" in result.stdout


def test_the_gpu_check_imports_everything_and_skips_without_cuda() -> None:
    result = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py")],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("SKIP: no CUDA")
