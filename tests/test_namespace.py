"""A user's own file names never break us: a training directory holding its own
`exporter.py`, `instrument/`, `dashboards/`, `diagnosis.py`, `core.py` and `catalogue.py`
(each of which fails loudly if imported) runs the drop-in, zero-code mode and the
sidecar from that directory, where Python looks first."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.procs import Exporter, http_get

from dataloader_exporter.core import catalogue as cat

pytestmark = [pytest.mark.torch, pytest.mark.slow]

USERS_OWN = {
    "exporter.py": "model export code",
    "instrument/__init__.py": "a package of the user's",
    "dashboards/__init__.py": "a package of the user's",
    "diagnosis.py": "a module of the user's",
    "core.py": "a module of the user's",
    "catalogue.py": "a module of the user's",
}
TRAIN = """
import sys
import torch
from torch.utils.data import TensorDataset
{import_line}

data = TensorDataset(torch.arange(16.0).unsqueeze(1))
loader = {loader}(data, batch_size=4, num_workers=1{extra})
seen = [batch[0].sum().item() for batch in loader]
assert len(seen) == 4, seen
assert not [m for m in ("exporter", "instrument", "dashboards", "diagnosis", "core",
                        "catalogue") if m in sys.modules], "a user's module was imported"
{after}
"""


@pytest.fixture(scope="module")
def users_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("users_repo")
    for name, what in USERS_OWN.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"raise RuntimeError('imported the user\\'s own {name} ({what})')\n")
    return root


def run(directory: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=directory, capture_output=True, text=True, timeout=180)


def dataloader_series(text: str) -> set[str]:
    return {line.split("{")[0] for line in text.splitlines()
            if line.startswith("dataloader_") and "{" in line}


def test_the_users_modules_would_break_whoever_imports_them(users_dir: Path) -> None:
    result = run(users_dir, [sys.executable, "-c", "import exporter"])
    assert result.returncode != 0 and "imported the user's own exporter.py" in result.stderr


def test_the_drop_in_runs_beside_the_users_own_modules(users_dir: Path, tmp_path: Path
                                                       ) -> None:
    script = users_dir / "train_drop_in.py"
    script.write_text(textwrap.dedent(TRAIN).format(
        import_line="import dataloader_exporter\nfrom dataloader_exporter import DataLoader",
        loader="DataLoader", extra=f", name='train', metrics_dir={str(tmp_path)!r}",
        after="dataloader_exporter.shutdown()"))
    result = run(users_dir, [sys.executable, script.name])
    assert result.returncode == 0, result.stderr
    snapshots = list(tmp_path.glob("*.prom"))
    assert len(snapshots) == 1, snapshots
    series = dataloader_series(snapshots[0].read_text())
    assert {cat.BATCHES.name, cat.WORKERS_CONFIGURED.name} <= series, series


def test_zero_code_mode_and_the_sidecar_run_from_the_users_directory(users_dir: Path,
                                                                     tmp_path: Path) -> None:
    script = users_dir / "train_plain.py"
    script.write_text(textwrap.dedent(TRAIN).format(
        import_line="from torch.utils.data import DataLoader", loader="DataLoader", extra="",
        after=""))
    result = run(users_dir, [sys.executable, "-m", "dataloader_exporter", "run",
                             "--metrics-dir", str(tmp_path), "--", sys.executable, script.name])
    assert result.returncode == 0, result.stderr
    assert "zero-code mode is off" not in result.stderr, result.stderr
    snapshots = list(tmp_path.glob("*.prom"))
    assert len(snapshots) == 1, (snapshots, result.stderr)
    assert cat.BATCHES.name in dataloader_series(snapshots[0].read_text())

    # The sidecar, started from the same directory (python -m puts it first on sys.path),
    # serves what the trainer wrote.
    exporter = Exporter("--stale-after=3600", "--no-collector.gpu",
                        env={"DATALOADER_EXPORTER_DIR": str(tmp_path)}, cwd=users_dir)
    try:
        status, body = http_get(exporter.url + "/metrics")
    finally:
        exporter.stop()
    assert status == 200
    assert cat.BATCHES.name in dataloader_series(body), body[:2000]
