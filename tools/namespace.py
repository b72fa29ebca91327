"""The installed namespace's modules as the checkout holds them: each file and the dotted
name it is installed under, read from setup.py (its NS and ROOTS), the one place that maps
the repository's top-level folders into `dataloader_exporter`.

Tools that walk the code by module name (tools/typecheck.py, tests/test_imports.py) read
it here rather than through the installed package, so they see each file once, where it
lives in the repository.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _setup_constants() -> tuple[str, tuple[str, ...]]:
    tree = ast.parse((REPO / "setup.py").read_text())
    found: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id in ("NS", "ROOTS"):
                found[target.id] = ast.literal_eval(node.value)
    ns, roots = found["NS"], found["ROOTS"]
    assert isinstance(ns, str) and isinstance(roots, tuple), "setup.py: NS and ROOTS"
    return ns, roots


NS, ROOTS = _setup_constants()


def folder(package: str) -> Path:
    """The folder of `package` (NS or one of ROOTS) in the checkout."""
    return REPO / NS if package == NS else REPO / package


def module_name(path: Path) -> str:
    """The dotted name a file of the namespace is installed under."""
    rel = path.resolve().relative_to(REPO)
    top = rel.parts[0]
    parts = list(rel.with_suffix("").parts)
    if top in ROOTS:
        parts.insert(0, NS)
    elif top != NS:
        raise ValueError(f"{path} is not part of {NS}")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def files(package: str, suffixes: tuple[str, ...] = (".py",)) -> list[Path]:
    """Every module file of `package` (NS: its own files only; a root: all of it, a
    folder without __init__.py such as the zero-code start-up hook's included), sorted."""
    base = folder(package)
    pattern = "*" if package == NS else "**/*"
    return sorted(p for suffix in suffixes for p in base.glob(pattern + suffix))


def all_files(suffixes: tuple[str, ...] = (".py",)) -> list[Path]:
    """Every module file of the namespace."""
    return [p for package in (NS, *ROOTS) for p in files(package, suffixes)]
