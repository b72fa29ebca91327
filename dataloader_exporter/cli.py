"""The dataloader-exporter command: a table of commands, each in its own module.

Each command module owns its arguments (``add_arguments(parser)``) and its work
(``run(args) -> exit status``) and is imported only when its command runs, so
`dataloader-exporter serve` never loads torch or grafanalib, and a command whose extra
is not installed says which extra to install instead of failing with a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

from dataloader_exporter import __version__

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


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        (sys.stdout if args else sys.stderr).write(_usage())
        return 0 if args else 2
    if args[0] == "--version":
        print(f"{PROG} {__version__}")
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
