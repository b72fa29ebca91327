"""The sidecar image's recipe, and a torch-free install of the exporter that serves."""

from __future__ import annotations

import re
import subprocess
import venv
from pathlib import Path

from procs import REPO, Exporter

from exporter import catalogue as cat
from exporter import config

DOCKERFILE = (REPO / "Dockerfile").read_text()


def instructions(name: str) -> list[str]:
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    return [line.split(None, 1)[1] for line in text.splitlines()
            if line.strip().upper().startswith(name + " ")]


def test_the_image_is_multi_stage_non_root_and_exposes_the_default_port() -> None:
    assert len(instructions("FROM")) >= 2
    assert "COPY --from=build" in DOCKERFILE
    users = instructions("USER")
    assert users and users[-1].strip() not in ("root", "0")
    assert instructions("EXPOSE") == [str(config.DEFAULT_PORT)]
    assert instructions("ENTRYPOINT") == ['["dataloader-exporter", "serve"]']


def test_the_image_installs_no_torch_and_copies_only_files_that_exist() -> None:
    for run in instructions("RUN"):
        assert "torch" not in run and "[" not in run.split("pip install")[-1]
    for copy in instructions("COPY"):
        if copy.startswith("--from"):
            continue
        *sources, _dest = copy.split()
        for src in sources:
            assert (REPO / src).exists(), src


def test_a_torch_free_install_runs_the_sidecar(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    str(REPO)], check=True, timeout=300, cwd=tmp_path)
    probe = subprocess.run([python, "-c", "import torch"], capture_output=True, cwd=tmp_path)
    assert probe.returncode != 0, "the base install must not bring torch"
    (tmp_path / "metrics").mkdir()
    script = env_dir / "bin" / "dataloader-exporter"
    version = subprocess.run([str(script), "--version"], capture_output=True, text=True,
                             cwd=tmp_path, timeout=60)
    assert version.returncode == 0 and "dataloader-exporter" in version.stdout
    # Run from a directory without the sources, so the installed package is what runs.
    exp = Exporter(f"--metrics-dir={tmp_path / 'metrics'}", python=python, cwd=tmp_path)
    try:
        assert cat.COLLECTOR_UP.name in exp.metrics()
    finally:
        assert exp.stop() == 0
