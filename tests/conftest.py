"""Shared fixtures (fresh registries, an injected clock, promtool and a real Prometheus), and
the rules that keep the markers `torch` and `slow` (pyproject.toml) honest.

The markers live with the tests: a module that needs torch throughout says
`pytestmark = pytest.mark.torch` (a list with `pytest.mark.slow` when all of it is slow);
a torch-free module marks its few tests that need torch `@pytest.mark.torch`; a slow test
is marked `@pytest.mark.slow`.

torch: the test needs torch, in its own process or one it starts. Where torch is not
installed (`make notorch`: the exporter, the doctor and the dashboards must work without
it), a module whose `pytestmark` names the torch marker is not collected (read from its
source, never imported), every other module is, and its tests marked torch are
deselected: a torch-free module that imports torch, or a helper that does
(support/torch_helpers.py), fails its collection there.

slow: the test takes seconds (a real Prometheus, torchrun, frameworks, many processes,
packaging venvs): `pytest -m "not slow"` (`make quick`) leaves them out. A test that uses
one of SLOW_FIXTURES (a real Prometheus, or a training run a module's tests share) is
marked slow explicitly like any other; collection stops with an error where one is not.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from support.clock import Clock
from support.kube import K8S, example_with_tls, kustomize
from support.procs import REPO, Prometheus
from support.required import require_binary

HAS_TORCH = importlib.util.find_spec("torch") is not None
# Fixtures that start a real Prometheus, or a training run that a module's tests share.
SLOW_FIXTURES = frozenset({"prometheus", "env_switch", "odd_ranks"})


@cache
def marks_torch(path: Path) -> bool:
    """Whether the test module at `path` marks all its tests torch: its top-level
    `pytestmark` names `pytest.mark.torch`, read from the source without importing it."""
    for node in ast.parse(path.read_bytes(), str(path)).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
            return any(isinstance(n, ast.Attribute) and n.attr == "torch"
                       and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"
                       for n in ast.walk(value))
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Without torch, leaves out the modules marked torch as a whole (and only those)."""
    if (not HAS_TORCH and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_") and marks_torch(collection_path)):
        return True
    return None


def _module_marks(item: pytest.Item) -> set[str]:
    marks = getattr(getattr(item, "module", None), "pytestmark", [])
    return {m.name for m in (marks if isinstance(marks, list) else [marks])}


@pytest.hookimpl(tryfirst=True)  # before -m selects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    misread = sorted({item.path.name for item in items
                      if ("torch" in _module_marks(item)) != marks_torch(item.path)})
    if misread:
        raise pytest.UsageError(
            f"write `pytestmark = pytest.mark.torch` (or a list with it) as a plain top-level "
            f"assignment, which can be read without importing the module: {misread}")
    unmarked = [item.nodeid for item in items if not item.get_closest_marker("slow")
                and SLOW_FIXTURES & set(getattr(item, "fixturenames", ()))]
    if unmarked:
        raise pytest.UsageError(f"mark these tests @pytest.mark.slow: they use one of "
                                f"{sorted(SLOW_FIXTURES)}: {unmarked}")
    if not HAS_TORCH:
        deselected = [item for item in items if item.get_closest_marker("torch")]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if not item.get_closest_marker("torch")]


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    """A registry of the test's own; its hub's snapshot threads and servers are stopped
    after the test, so that they do not load the machine for every later test."""
    reg = CollectorRegistry()
    yield reg
    # none without the instrumentation imported
    hub = sys.modules.get("dataloader_exporter.instrument.hub")
    if hub is not None:
        hub.hub_for(reg).close()


@pytest.fixture
def clock() -> Clock:
    """A clock of the test's own for code that takes `clock=`: it starts at the wall-clock
    time and moves only when the test sets `clock.now` or calls `clock.advance()`."""
    return Clock()


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_binary("promtool")


@pytest.fixture(scope="session")
def kubectl() -> str:
    """kubectl (its built-in kustomize renders offline, no cluster needed)."""
    return require_binary("kubectl", "it carries kustomize; no cluster is needed")


@pytest.fixture(scope="session")
def example(kubectl: str) -> list[dict[str, Any]]:
    """deploy/kubernetes/example rendered with kustomize."""
    return kustomize(kubectl, K8S / "example")


@pytest.fixture(scope="session")
def example_tls(kubectl: str, tmp_path_factory: pytest.TempPathFactory
                ) -> list[dict[str, Any]]:
    """The example with the tls component."""
    return example_with_tls(kubectl, tmp_path_factory)


@pytest.fixture(scope="session")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """One real Prometheus for the whole session, evaluating the committed recording rules
    every second; tests add file_sd targets to it."""
    server = Prometheus(require_binary("prometheus"), tmp_path_factory.mktemp("prometheus"),
                        rule_files=[str(REPO / "deploy" / "prometheus" / "recording.yml")])
    yield server
    server.stop()
