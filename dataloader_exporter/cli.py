"""The dataloader-exporter command: a table of commands, each in its own module.

Each command module owns its arguments (``add_arguments(parser)``) and its work
(``run(args) -> exit status``) and is imported only when its command runs, so
`dataloader-exporter serve` never loads torch or grafanalib, and a command whose extra
is not installed says which extra to install instead of failing with a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from dataloader_exporter import __version__
from dataloader_exporter.core.envnames import ENV_PURE_PYTHON, pure_python_asked

PROG = "dataloader-exporter"


@dataclass(frozen=True)
class Command:
    module: str
    help: str
    extra: str | None = None  # the pip extra the module's imports need
    needs: tuple[str, ...] = ()  # the top-level modules that extra provides


COMMANDS: dict[str, Command] = {
    "serve": Command("dataloader_exporter.exporter.serve_cli", "serve /metrics (sidecar mode)"),
    "doctor": Command("dataloader_exporter.diagnosis.doctor_cli",
                      "diagnose the input pipeline and say what to change"),
    "top": Command("dataloader_exporter.diagnosis.top",
                   "live terminal view of an exporter's DataLoader metrics"),
    "run": Command("dataloader_exporter.run",
                   "run a program with its DataLoaders instrumented, no code changes"),
    "demo": Command("dataloader_exporter.demo",
                    "a starved and a tuned CPU training run, side by side",
                    "torch", ("torch", "numpy")),
    "dashboards": Command("dataloader_exporter.dashboards.dashboards_cli",
                          "write Grafana dashboards, alerts and rules",
                          "dashboards", ("grafanalib", "attr", "attrs", "yaml")),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {PROG} COMMAND [options]", "",
             "Prometheus metrics, Grafana dashboards and a doctor for PyTorch input pipelines.",
             "", "commands:"]
    lines += [f"  {name:<{width}}  {c.help}" + (f" (needs the {c.extra} extra)" if c.extra
                                                  else "") for name, c in COMMANDS.items()]
    lines += ["", f"`{PROG} COMMAND --help` for a command's options; `{PROG} --version`."]
    return "\n".join(lines) + "\n"


def load(name: str) -> ModuleType | str:
    """The command's module, or the one-line reason it cannot be loaded."""
    command = COMMANDS[name]
    try:
        return importlib.import_module(command.module)
    except ModuleNotFoundError as e:
        missing = (e.name or "").split(".")[0]
        if command.extra is None or missing not in command.needs:
            raise
        return (f"`{PROG} {name}` needs the {command.extra} extra ({missing} is not "
                f"installed): pip install '{PROG}[{command.extra}]'")


def hot_path_build() -> str:
    """Which build of the loader's per-batch path a trainer of this install runs, found
    without importing torch or the extension: the C extension where it was built at
    install, else the same code in Python (docs/design/hotpath.md)."""
    if importlib.util.find_spec("torch") is None:
        return "none (the trainer side needs the torch extra)"
    if pure_python_asked():
        return f"Python ({ENV_PURE_PYTHON} is set)"
    spec = importlib.util.find_spec("dataloader_exporter.instrument")  # not run: no torch
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            built = Path(folder, "hotpath", "_hotpath" + suffix)
            if built.is_file():
                return f"C ({built})"
    return "Python (instrument/hotpath/_hotpath.c was not built at install)"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        (sys.stdout if args else sys.stderr).write(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        print(f"{PROG} {__version__}\nper-batch path: {hot_path_build()}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        sys.stderr.write(f"{PROG}: error: unknown command {name!r}\n\n{_usage()}")
        return 2
    module = load(name)
    if isinstance(module, str):
        print(f"{PROG}: error: {module}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"{PROG} {name}",
                                     description=getattr(module, "DESCRIPTION", None)
                                     or COMMANDS[name].help)
    module.add_arguments(parser)
    parsed, unknown = parser.parse_known_args(rest)
    if unknown and not getattr(module, "REPORTS_UNKNOWN_FLAGS", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    parsed.unknown_flags = unknown
    return int(module.run(parsed))
