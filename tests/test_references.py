"""What a comment, a docstring or a page cites exists: a file named `name.py` (or `.pyi`,
`.c`, `.md`) in the code, the benchmarks, the tools and the docs resolves to a file of the
repository (a path, from the citing file's folder or one above it, from the repository or
from docs/; a bare name, anywhere in it), so a module that moves or goes takes its
citations with it. The tests cite the files they make; they are not read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CODE = ("core", "exporter", "instrument", "diagnosis", "dashboards", "dataloader_exporter",
        "bench", "tools", "examples", "docker")
ROOTS = ("core", "exporter", "instrument", "diagnosis", "dashboards")
CITED = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[A-Za-z_][\w-]*\.(?:py|pyi|c|md))\b")
# Files cited that are not ours to hold: a user's, a framework's, another project's.
ELSEWHERE = {
    "train.py", "exporter.py", "sitecustomize.py", "setup.py", "dataloader.py", "conftest.py",
    "model.cc", "docker-compose.yml", "prometheus.yml", "mkdocs.yml", "README.md",
    "__init__.py", "torch/utils/data/dataloader.py", "worker.py", "pyproject.toml",
    "data.py", "test/stateful_dataloader/test_state_dict.py", "test_state_dict_subset.py",
    "torch/utils/data/_utils/signal_handling.py",
}


def _tracked_names() -> set[str]:
    return {p.name for p in REPO.rglob("*") if p.is_file() and not {
        ".git", ".venv", ".venv-notorch", "site", "build"} & set(p.relative_to(REPO).parts)}


NAMES = _tracked_names()


def _resolves(source: Path, cited: str) -> bool:
    """A path: beside `source`, from a folder above it up to the repository (a package
    names its modules from its own root), from a package's root, or from docs/. A bare
    name: anywhere."""
    if "/" not in cited:
        return cited in NAMES
    here = [parent / cited for parent in source.parents if REPO in (parent, *parent.parents)]
    roots = [REPO / root / cited for root in ROOTS]
    return any(c.exists() for c in [*here, *roots, REPO / "docs" / cited])


def _sources() -> list[Path]:
    files = [p for folder in CODE for suffix in (".py", ".pyi", ".c", "Dockerfile")
             for p in (REPO / folder).rglob(f"*{suffix}")]
    files += [*(REPO / "docs").rglob("*.md"), REPO / "README.md", REPO / "Makefile",
              REPO / "setup.py", REPO / "Dockerfile", REPO / "pyproject.toml",
              REPO / ".ci" / "run"]
    return sorted(set(files))


def unresolved(source: Path) -> list[str]:
    text = source.read_text()
    found = []
    for cited in sorted(set(CITED.findall(text))):
        if cited in ELSEWHERE or (Path(cited).name in ELSEWHERE and "/" not in cited):
            continue
        if cited.startswith(("http", "www.")) or "<" in cited:
            continue
        if not _resolves(source, cited):
            found.append(cited)
    return found


def test_every_cited_file_exists() -> None:
    broken = {str(p.relative_to(REPO)): bad for p in _sources() if (bad := unresolved(p))}
    assert not broken, broken


def test_a_citation_of_a_file_that_is_gone_is_found() -> None:
    probe = REPO / "instrument" / "hotpath" / "_probe_for_the_test.py"
    try:
        probe.write_text('"""See recorder.py, hotpath_base.py, core/tuner/rules.py and '
                         'instrument/recorder.py."""\n')
        assert unresolved(probe) == ["hotpath_base.py", "instrument/recorder.py"]
    finally:
        probe.unlink()


@pytest.mark.parametrize("root", ROOTS)
def test_each_package_is_cited_somewhere_in_the_docs(root: str) -> None:
    docs = "\n".join(p.read_text() for p in (REPO / "docs").rglob("*.md"))
    assert f"{root}/" in docs
