"""The import rules of STYLE.md, kept by walking every module's imports (function-level
ones included): exporter/ is the base; diagnosis/, instrument/ and dashboards/ build on
it; only the command table names them all, and it loads each command lazily."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("dataloader_exporter", "exporter", "diagnosis", "instrument", "dashboards")
# package -> top-level modules it must never import, not even inside a function
FORBIDDEN = {
    "exporter": {"torch", "numpy", "instrument", "dashboards", "diagnosis", "grafanalib",
                 "dataloader_exporter"},
    "diagnosis": {"torch", "numpy", "instrument", "dashboards", "grafanalib",
                  "dataloader_exporter"},
    "dashboards": {"torch", "numpy", "instrument", "diagnosis", "dataloader_exporter"},
    "instrument": {"dashboards", "grafanalib", "dataloader_exporter"},
    # The command table imports no command's module: importlib loads the one asked for.
    "dataloader_exporter": {"torch", "numpy", "instrument", "dashboards", "diagnosis",
                            "grafanalib"},
}


def imports(path: Path, package: str) -> set[str]:
    """Top-level names of every module `path` (in `package`) imports, wherever the import
    statement is; a relative import is the package itself."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add(package if node.level else (node.module or "").split(".")[0])
    return found


def modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_only_what_it_may(package: str) -> None:
    assert modules(package), package
    broken = {f"{p.relative_to(REPO)} imports {name}" for p in modules(package)
              for name in imports(p, package) & FORBIDDEN[package]}
    assert not broken, sorted(broken)


def test_the_rule_walker_sees_imports_inside_functions(tmp_path: Path) -> None:
    bad = tmp_path / "probe.py"
    bad.write_text("def f():\n    import torch\n    from instrument import hub\n"
                   "    from . import catalogue\n")
    assert imports(bad, "exporter") == {"torch", "instrument", "exporter"}


def test_every_command_module_loads_and_owns_its_arguments() -> None:
    from dataloader_exporter.cli import COMMANDS

    for name, command in COMMANDS.items():
        code = (f"import argparse, importlib, sys; m = importlib.import_module({command.module!r})"
                "; p = argparse.ArgumentParser(); m.add_arguments(p); assert callable(m.run); "
                "print(sorted(n.split('.')[0] for n in sys.modules))")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                cwd=REPO, timeout=120)
        assert result.returncode == 0, (name, result.stderr)
        loaded = set(eval(result.stdout))
        if name in ("serve", "doctor", "top"):  # the base and the client: no torch, no grafanalib
            assert not loaded & {"torch", "grafanalib", "instrument", "dashboards"}, name


def test_the_command_list_loads_no_command() -> None:
    code = ("import sys; from dataloader_exporter.cli import main; main(['--help']); "
            "sys.exit(bool({'exporter.command', 'diagnosis', 'instrument', 'dashboards', "
            "'torch'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "serve" in result.stdout and "dashboards" in result.stdout
