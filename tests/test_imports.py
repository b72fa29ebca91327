"""The import rules, kept by walking every module's imports
(function-level ones included): one installed namespace, ``dataloader_exporter``; core/ is
the standard-library base; exporter/ builds on it; diagnosis/, instrument/ and
dashboards/ build on those; only the command table names them all, and it loads each
command lazily. No module-level import cycles."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import support.namespace as namespace
from support.namespace import NS, REPO

PACKAGES = ("core", "exporter", "diagnosis", "instrument", "dashboards")
THIRD_PARTY = {"torch", "numpy", "grafanalib", "prometheus_client", "pynvml", "psutil", "yaml",
               "bcrypt"}
# What each package may import: its own modules, the standard library, these of ours
# (dataloader_exporter.X), and these third-party modules; nothing else, not even inside a
# function.
MAY = {
    "core": ({"core"}, set()),
    "exporter": ({"core", "exporter"}, {"prometheus_client", "pynvml", "yaml", "bcrypt"}),
    "diagnosis": ({"core", "exporter", "diagnosis"}, {"prometheus_client"}),
    "dashboards": ({"core", "dashboards"}, {"grafanalib", "yaml"}),
    "instrument": ({"core", "exporter", "instrument"},
                   {"torch", "numpy", "prometheus_client", "psutil"}),
}
# The trainer side's modules import these of the exporter only inside the function that
# serves in-process: the drop-in loads no HTTP server, asyncio or web configuration.
SERVING = {"exporter.web.server", "exporter.web.connection", "exporter.web.pacer",
           "exporter.web.wire", "exporter.web.webconfig", "exporter.web.basic_auth",
           "exporter.config", "exporter.serve_cli", "exporter.scrape", "exporter.sources"}


def _name(path: Path) -> str:
    """The dotted name a module is installed under, without the namespace ("" for the
    namespace's own __init__)."""
    return namespace.module_name(path)[len(NS) + 1:]


# Every module and package of ours, by its dotted name as installed.
KNOWN = {namespace.module_name(p) for p in namespace.all_files((".py", ".pyi"))}


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([NS, *base, *([node.module] if node.module else [])])


def imported(path: Path, top_level_only: bool = False, module: str | None = None
             ) -> set[str]:
    """Every module `path` imports (absolute dotted names; a relative import made
    absolute; `from P import m` gives P.m where m is a module, else P). With
    top_level_only, the imports a module runs when it is imported: not those inside
    functions or under `if TYPE_CHECKING:`. `module` names a file outside the namespace
    (without NS)."""
    module = module or _name(path)
    tree = ast.parse(path.read_text(), str(path))
    nodes: list[ast.AST] = []
    if top_level_only:
        todo: list[ast.AST] = list(tree.body)
        while todo:
            node = todo.pop()
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                todo += node.orelse
            elif isinstance(node, ast.If | ast.Try | ast.With):
                todo += [n for field in ("body", "orelse", "finalbody", "handlers")
                         for n in getattr(node, field, [])]
            elif isinstance(node, ast.ExceptHandler):
                todo += node.body
            else:
                nodes.append(node)
    else:
        nodes = list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, path.name == "__init__.py")
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if base == NS:  # the namespace's own names: __version__, the drop-in
                    found.add(sub)
                    continue
                is_module = sub in KNOWN
                found.add(sub if is_module else base)
    return found


def modules(package: str) -> list[Path]:
    return namespace.files(package)


def ours(name: str) -> str | None:
    """`name` without the namespace, None for a module that is not ours."""
    return name[len(NS) + 1:] if name.startswith(NS + ".") else None


def test_the_namespace_maps_every_top_level_folder_and_git_tracks_no_link() -> None:
    assert set(namespace.ROOTS) == set(PACKAGES)
    for package in PACKAGES:
        assert (REPO / package / "__init__.py").is_file(), package
        assert not (REPO / NS / package).exists(), f"{NS}/{package} would shadow {package}/"
    tracked = subprocess.run(["git", "ls-files", "-s"], capture_output=True, text=True,
                             cwd=REPO, check=True).stdout.splitlines()
    links = [line.split("\t", 1)[1] for line in tracked if line.startswith("120000")]
    assert not links, links


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_only_what_it_may(package: str) -> None:
    allowed_ours, allowed_others = MAY[package]
    assert modules(package), package
    broken = set()
    for path in modules(package):
        for name in imported(path):
            top = name.split(".")[0]
            mine = ours(name)
            if mine == "__version__":
                ok = True
            elif mine is not None:
                ok = mine.split(".")[0] in allowed_ours
            elif top == NS:
                ok = False  # the namespace's own top (cli, demo, the lazy drop-in)
            else:
                ok = top in sys.stdlib_module_names or top in allowed_others
            if not ok:
                broken.add(f"{_rel(path)} imports {name}")
    assert not broken, sorted(broken)


def test_no_module_imports_a_bare_package_name_a_users_file_could_shadow() -> None:
    bare = {"core", "exporter", "instrument", "diagnosis", "dashboards", "catalogue"}
    broken = {f"{_rel(p)} imports {n}" for package in PACKAGES
              for p in modules(package) for n in imported(p) if n.split(".")[0] in bare}
    broken |= {f"{p.name} imports {n}" for p in modules(NS) for n in imported(p)
               if n.split(".")[0] in bare}
    assert not broken, sorted(broken)


# Files that name a bare package on purpose: the user's own module that must not be ours,
# an old checkout's import measured beside ours, and this file.
MEANT = {"test_namespace.py", "import_cost.py", "test_imports.py"}


def test_no_script_test_or_benchmark_imports_a_bare_package_name() -> None:
    """Code in strings too (the scripts tests run): a bare `import instrument` would load
    a second copy of a module from the checkout, or nothing at all once installed."""
    bare = re.compile(r"(?:^|[\"';]\s*)(?:from|import) (?:core|exporter|instrument|diagnosis|"
                      r"dashboards)\b", re.M)
    found = [f"{p.relative_to(REPO)}: {m.group(0).strip()}"
             for folder in ("tests", "bench", "examples") for p in (REPO / folder).rglob("*.py")
             for m in bare.finditer(p.read_text()) if p.name not in MEANT]
    assert not found, found


def test_the_trainer_side_loads_the_server_only_to_serve() -> None:
    broken = {f"{_rel(p)} imports {n}" for p in modules("instrument")
              for n in imported(p, top_level_only=True)
              if (ours(n) or "") in SERVING or (ours(n) or "").startswith("diagnosis")}
    assert not broken, sorted(broken)


def test_the_core_imports_the_standard_library_only() -> None:
    broken = {f"{_rel(p)} imports {n}" for p in modules("core")
              for n in imported(p) if ours(n) is None and
              n.split(".")[0] not in sys.stdlib_module_names}
    assert not broken, sorted(broken)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports anywhere: at the top, in a function (a
    lazy import is a dependency all the same) or for type checking."""
    graph: dict[str, set[str]] = {}
    for path in [*modules(NS), *(p for pkg in PACKAGES for p in modules(pkg))]:
        if "autorun" in path.parts:
            continue
        name = _name(path)
        graph[name] = {m for n in imported(path)
                       if (m := ours(n)) is not None and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of the graph, each as a path that returns to its start."""
    found, state = [], dict.fromkeys(graph, 0)  # 0 new, 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*stack[stack.index(nxt):], nxt])
            elif state.get(nxt) == 0:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if state[node] == 0:
            visit(node)
    return found


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 60 and graph["instrument.loader"], graph.get("instrument.loader")
    assert not cycles(graph), cycles(graph)


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_rule_walker_sees_imports_inside_functions_and_relative_ones(tmp_path: Path
                                                                        ) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import typing\nfrom . import gpu_nvml\nif typing.TYPE_CHECKING:\n"
                     "    import numpy\ndef f():\n    import torch\n"
                     "    from ..web.server import serve\n")
    name = "exporter.collectors.base"  # read as if it were this module
    assert imported(probe, module=name) == {
        "typing", "numpy", "torch", f"{NS}.exporter.collectors.gpu_nvml",
        f"{NS}.exporter.web.server"}
    assert imported(probe, top_level_only=True, module=name) == {
        "typing", f"{NS}.exporter.collectors.gpu_nvml"}


@pytest.mark.torch  # it imports the demo's and the drop-in's modules
@pytest.mark.slow
def test_every_command_module_loads_and_owns_its_arguments() -> None:
    from dataloader_exporter.cli import COMMANDS

    for name, command in COMMANDS.items():
        code = (f"import argparse, importlib, sys; m = importlib.import_module({command.module!r})"
                "; p = argparse.ArgumentParser(); m.add_arguments(p); assert callable(m.run); "
                "print(sorted(sys.modules))")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                cwd=REPO, timeout=120)
        assert result.returncode == 0, (name, result.stderr)
        loaded = set(eval(result.stdout))
        if name in ("serve", "doctor", "top"):  # the base and the client: no torch, no grafanalib
            assert not {m.split(".")[0] for m in loaded} & {"torch", "grafanalib"}, name
            assert not {f"{NS}.instrument", f"{NS}.dashboards"} & loaded, name


def test_the_command_list_loads_no_command() -> None:
    code = ("import sys; from dataloader_exporter.cli import main; main(['--help']); "
            "sys.exit(sorted({'dataloader_exporter.exporter.serve_cli', "
            "'dataloader_exporter.diagnosis', 'dataloader_exporter.instrument', "
            "'dataloader_exporter.dashboards', 'torch'} & set(sys.modules)) or 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "serve" in result.stdout and "dashboards" in result.stdout


def loaded_after_torch(code: str) -> set[str]:
    """The modules `code` loads in a fresh process that imported torch first, as a
    training script does."""
    script = ("import sys, torch, torch.utils.data; before = set(sys.modules); "
              f"{code}; print(sorted(set(sys.modules) - before))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    return set(eval(result.stdout))


@pytest.mark.torch  # it imports the demo's and the drop-in's modules
@pytest.mark.slow
def test_the_drop_in_loads_neither_the_server_nor_the_doctor() -> None:
    """Measured in a process that imports torch first, as a training script does."""
    new = loaded_after_torch("from dataloader_exporter import DataLoader, wrap")
    assert f"{NS}.instrument.loader" in new
    served = {m for m in new if (ours(m) or "") in SERVING or (ours(m) or "").startswith(
        ("diagnosis", "dashboards"))}
    assert not served, sorted(served)
    # (http.server is prometheus_client's own: its exposition module, write_to_textfile's,
    # imports it. Ours is asyncio.)
    assert not new & {"asyncio", "ssl", "yaml", "bcrypt", "pynvml", "psutil"}, sorted(new)


# What `import dataloader_exporter; dataloader_exporter.DataLoader` may load after torch,
# building a loader and taking its first batch included: the hot path and what it needs
# to start. prometheus_client, the snapshot writer, the tuner and serving are loaded on
# first use (bench/import_cost.py measures the import).
DROP_IN_MAY_LOAD = {f"{NS}.{m}" if m else NS for m in (
    "", "core", "core.advisor", "core.bands", "core.catalogue", "core.envnames", "core.facts",
    "core.facts.cgroup", "core.facts.cores", "core.facts.memory", "core.facts.shm",
    "core.logonce", "core.problems", "core.settings", "instrument", "instrument.compat",
    "instrument.envsettings", "instrument.failure_causes", "instrument.hotpath",
    "instrument.hotpath._hotpath", "instrument.hotpath.base", "instrument.hotpath.batch",
    "instrument.hotpath.iterator", "instrument.hotpath.layout", "instrument.hotpath.recorder",
    "instrument.hotpath.transfer", "instrument.hotpath.workerblock", "instrument.hub",
    "instrument.instruments", "instrument.iter_start", "instrument.loader",
    "instrument.memgrowth", "instrument.naming", "instrument.preflight", "instrument.procstat",
    "instrument.rank", "instrument.rank_gpu", "instrument.serve", "instrument.torch_originals",
    "instrument.worker_tracker", "instrument.zerocode", "instrument.zerocode.holders",
    "instrument.zerocode.hooks", "instrument.zerocode.registry")}
LOADED_ON_FIRST_USE = ("prometheus_client", "http", "wsgiref", "socketserver", "asyncio",
                       f"{NS}.exporter", f"{NS}.diagnosis", f"{NS}.dashboards",
                       f"{NS}.instrument.tuner", f"{NS}.instrument.snapshot_writer",
                       f"{NS}.instrument.loader_collector", f"{NS}.core.tuner")


@pytest.mark.torch  # it builds a loader and takes a batch
@pytest.mark.slow
def test_the_drop_in_and_its_first_batch_load_only_what_the_hot_path_needs() -> None:
    """Measured in a process that imports torch first; the modules torch itself loads for
    a first batch are torch's, not the drop-in's."""
    new = loaded_after_torch("import dataloader_exporter; L = dataloader_exporter.DataLoader; "
                             "ds = torch.utils.data.TensorDataset(torch.arange(8.0)); "
                             "batch = next(iter(L(ds, batch_size=2)))")
    ours_loaded = {m for m in new if m.split(".")[0] == NS}
    assert ours_loaded <= DROP_IN_MAY_LOAD, sorted(ours_loaded - DROP_IN_MAY_LOAD)
    assert f"{NS}.instrument.hotpath.iterator" in ours_loaded
    early = sorted(m for m in new if m.startswith(LOADED_ON_FIRST_USE))
    assert not early, early
    others = sorted(m for m in new if m.split(".")[0] not in (NS, "torch", "numpy"))
    assert not others, others


def test_a_concept_has_a_folder_not_a_name_prefix() -> None:
    """Modules that share a name prefix in one folder (hotpath_base, hotpath_batch,
    hotpath_iterator...) are a concept that wants its own folder (hotpath/base.py, ...):
    no prefix is shared by three modules of a folder."""
    by_prefix: dict[tuple[str, str], list[str]] = {}
    for path in namespace.all_files():
        stem = path.stem
        if "_" in stem.strip("_"):
            by_prefix.setdefault((_rel(path.parent), stem.split("_")[0]), []).append(stem)
    crowded = {k: v for k, v in by_prefix.items() if len(v) >= 3}
    assert not crowded, crowded
