"""The docs site builds with --strict (every link and anchor resolves), every page is in its
nav, and the README stays a short front door whose links all lead somewhere."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
README_MAX_BYTES = 15_000
# Markdown links and images: [text](target) and ![alt](target).
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _nav_pages(nav: list[Any]) -> set[str]:
    pages: set[str] = set()
    for item in nav:
        if isinstance(item, str):
            pages.add(item)
        elif isinstance(item, dict):
            for value in item.values():
                pages |= _nav_pages(value) if isinstance(value, list) else {value}
    return pages


def test_the_site_builds_with_strict_checks(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "index.html").is_file()
    assert (tmp_path / "metrics" / "index.html").is_file()


def test_every_page_in_docs_is_in_the_nav() -> None:
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    in_nav = _nav_pages(config["nav"])
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert pages - in_nav == set(), "add these pages to mkdocs.yml's nav"
    assert in_nav - pages == set(), "the nav names pages that do not exist"


def test_the_readme_is_short() -> None:
    size = len((REPO / "README.md").read_bytes())
    assert size < README_MAX_BYTES, \
        f"README.md is {size} bytes: move detail into docs/ and link to it"


def test_the_readme_links_only_to_files_that_exist() -> None:
    missing = []
    for target in LINK.findall((REPO / "README.md").read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL, or an anchor in the README itself
        path = target.split("#", 1)[0]
        if not (REPO / path).exists():
            missing.append(target)
    assert missing == []


def test_the_performance_page_gives_current_figures_not_a_diary() -> None:
    """Each figure once, with its command and target; its history is in the commit log."""
    text = (REPO / "docs" / "performance.md").read_text()
    assert len(text.splitlines()) <= 250
    assert len(re.findall(r"\b20\d\d-\d\d-\d\d\b", text)) <= 8
