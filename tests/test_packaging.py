"""The sidecar image's recipe, and each extra installed alone in a fresh venv: the base
(the sidecar, no torch), dashboards, and torch, each running the commands it enables
and saying which extra the others need."""

from __future__ import annotations

import re
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
import support.namespace as namespace
from support.procs import REPO, Exporter

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.exporter import config

pytestmark = [pytest.mark.torch, pytest.mark.slow]

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


def test_both_images_copy_the_checkout_and_ignore_none_of_what_the_wheel_needs() -> None:
    """The images copy the build context whole (`COPY . .`), so no list of folders there
    follows the tree; .dockerignore leaves in every folder setup.py maps into the
    namespace, and setup.py and pyproject.toml."""
    needed = {"setup.py", "pyproject.toml", "README.md", namespace.NS, *namespace.ROOTS}
    ignored = {line.strip().rstrip("/") for line in
               (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert not needed & ignored, needed & ignored
    for dockerfile in (REPO / "Dockerfile", REPO / "docker" / "trainer.Dockerfile"):
        text = re.sub(r"\\\n", " ", dockerfile.read_text())
        copies = [line.split()[1:] for line in text.splitlines()
                  if line.startswith("COPY ") and "--from" not in line]
        assert [".", "."] in copies, (dockerfile.name, copies)


PIP = ("-m", "pip", "install", "--quiet", "--disable-pip-version-check")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project built once as a wheel, for every fresh venv below."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--disable-pip-version-check", "-w", str(out), str(REPO)], check=True,
                   timeout=300, cwd=out)
    wheel = next(out.glob("dataloader_exporter-*.whl"))
    # Only modules of the source tree: a stale build/ must not ship deleted ones.
    with zipfile.ZipFile(wheel) as z:
        shipped = {n for n in z.namelist() if n.endswith(".py")}
    assert shipped and shipped <= installed_names(), sorted(shipped - installed_names())
    return wheel


def installed_names() -> set[str]:
    """Each module file of the checkout, as the path it is installed under."""
    return {namespace.module_name(p).replace(".", "/")
            + ("/__init__" if p.name == "__init__.py" else "") + p.suffix
            for p in namespace.all_files((".py", ".pyi"))}


def fresh_venv(directory: Path, *requirements: str) -> Path:
    venv.create(directory, with_pip=True)
    python = directory / "bin" / "python"
    subprocess.run([str(python), *PIP, *requirements], check=True, timeout=600,
                   cwd=directory.parent)
    return python


def command(python: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """The installed console script, run from outside the sources."""
    return subprocess.run([str(python.parent / "dataloader-exporter"), *argv],
                          capture_output=True, text=True, cwd=python.parent.parent.parent,
                          timeout=300)


def test_a_torch_free_install_runs_the_sidecar_and_names_the_extras_it_lacks(
        tmp_path: Path, wheel: Path) -> None:
    python = fresh_venv(tmp_path / "venv", str(wheel))
    probe = subprocess.run([str(python), "-c", "import torch"], capture_output=True,
                           cwd=tmp_path)
    assert probe.returncode != 0, "the base install must not bring torch"
    version = command(python, "--version")
    assert version.returncode == 0 and "dataloader-exporter" in version.stdout
    assert "per-batch path: none (the trainer side needs the torch extra)" in version.stdout
    for name, extra in (("demo", "torch"), ("dashboards", "dashboards")):
        result = command(python, name)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert f"pip install 'dataloader-exporter[{extra}]'" in result.stderr
    assert command(python, "doctor", "--help").returncode == 0
    # --web.config.file needs PyYAML and bcrypt: the base install has them.
    (tmp_path / "web.yml").write_text("basic_auth_users: {}\n")
    (tmp_path / "metrics").mkdir()
    # Run from a directory without the sources, so the installed package is what runs.
    exp = Exporter(f"--metrics-dir={tmp_path / 'metrics'}",
                   f"--web.config.file={tmp_path / 'web.yml'}", python=str(python),
                   cwd=tmp_path)
    try:
        assert cat.COLLECTOR_UP.name in exp.metrics()
    finally:
        assert exp.stop() == 0


def test_the_dashboards_extra_alone_writes_the_dashboards(tmp_path: Path, wheel: Path) -> None:
    python = fresh_venv(tmp_path / "venv", f"{wheel}[dashboards]")
    result = command(python, "dashboards", "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "grafana" / "dashboards" / "dataloader-overview.json").exists()
    assert (tmp_path / "out" / "prometheus" / "rules.yml").exists()


def test_the_torch_extra_alone_runs_an_instrumented_loader(tmp_path: Path, wheel: Path) -> None:
    # torch first and pinned, as the README says: an unpinned one pulls a CUDA build.
    import torch

    python = fresh_venv(tmp_path / "venv", f"torch=={torch.__version__.split('+')[0]}")
    subprocess.run([str(python), *PIP, f"{wheel}[torch]"], check=True, timeout=600,
                   cwd=tmp_path)
    code = ("from dataloader_exporter import DataLoader; "
            "dl = DataLoader(list(range(6)), batch_size=2); "
            "print(sum(len(b) for b in dl))")
    result = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                            cwd=tmp_path, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "6", result.stderr
    assert command(python, "demo", "--help").returncode == 0
    # The wheel was built here, with a C compiler: its per-batch path is the C build.
    code = ("from dataloader_exporter.instrument.hotpath import base; "
            "print(base.NATIVE, base.Timed.__module__)")
    built = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                           cwd=tmp_path, timeout=300)
    assert built.stdout.split() == ["True", "dataloader_exporter.instrument.hotpath._hotpath"]
    assert "per-batch path: C (" in command(python, "--version").stdout


def test_the_wheel_ships_zero_code_modes_start_up_hook(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        assert "dataloader_exporter/instrument/autorun/sitecustomize.py" in z.namelist()


def test_the_wheel_installs_one_namespace_with_every_module_once(wheel: Path) -> None:
    """Nothing but dataloader_exporter at the top of site-packages (a user's own
    exporter.py or instrument/ can shadow no module of ours), and every module of the
    checkout's mapped folders shipped once, under its installed name."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"dataloader_exporter", "dataloader_exporter-0.1.0.dist-info"}, tops
    shipped = [n for n in names if n.endswith((".py", ".pyi"))]
    assert len(shipped) == len(set(shipped))
    assert set(shipped) == installed_names(), sorted(set(shipped) ^ installed_names())
