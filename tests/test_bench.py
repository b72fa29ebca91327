"""The benchmarks and the prepared GPU check still start: a moved import once broke them
silently (no test ran them, and mypy does not read bench/). On a machine with a GPU the
GPU check runs and must pass."""

from __future__ import annotations

import json
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


CHECKS = ("events", "bytes", "overlap", "nvml", "uuid")  # bench/gpu_check.py's


def test_the_gpu_check_passes_on_a_gpu_and_skips_clearly_without() -> None:
    """On a machine with CUDA every check passes; elsewhere it imports everything, says
    it skipped, and exits 0."""
    cuda = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert cuda.returncode == 0, cuda.stderr
    result = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py")],
                            capture_output=True, text=True, timeout=240, cwd=REPO)
    if cuda.stdout.strip() != "True":
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("SKIP: no CUDA"), result.stdout
        return
    lines = result.stdout.splitlines()
    assert result.returncode == 0, (result.stdout, result.stderr[-4000:])
    for check in CHECKS:  # one line each: PASS  name: {details}
        assert any(line.startswith(f"PASS  {check}: ") for line in lines), (check, lines)
    summary = json.loads(lines[-1])
    assert summary["checks"] == dict.fromkeys(CHECKS, "PASS"), summary
