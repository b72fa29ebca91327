"""`dataloader-exporter run -- COMMAND`: zero-code mode, like `opentelemetry-instrument`.

Runs COMMAND (exec, so signals and the exit status are its own) with the environment
that instruments every torch DataLoader iterated in it and in every Python process it
starts: instrument/autorun first on PYTHONPATH (its sitecustomize installs the hook once
torch is imported) and DATALOADER_EXPORTER_AUTO=1. Imports neither torch nor instrument.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys

from dataloader_exporter.core.envnames import ENV_AUTO, ENV_DIR, ENV_SETTINGS
from dataloader_exporter.core.settings import SettingsError, parse

DESCRIPTION = ("Run COMMAND with every torch DataLoader in it, and in the Python processes "
               "it starts (torchrun ranks, Lightning's DDP processes, accelerate launch), "
               "instrumented without code changes.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = "%(prog)s [--metrics-dir DIR] [--settings LINE] -- COMMAND [ARGS...]"
    parser.add_argument("--metrics-dir", help=f"write snapshot files here for the sidecar "
                        f"(env {ENV_DIR})")
    parser.add_argument("--settings", help=f"loader settings, e.g. 'train.num_workers=8,"
                        f"*.persistent_workers=true' (env {ENV_SETTINGS})")
    parser.add_argument("--print-env", action="store_true",
                        help="print the variables that turn zero-code mode on (for an image "
                             "or a pod spec whose command you cannot change), and exit")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program and its "
                        "arguments, after --")


def autorun_dir() -> str:
    """The directory whose sitecustomize.py turns zero-code mode on (not imported here)."""
    spec = importlib.util.find_spec("dataloader_exporter.instrument")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the instrument package is not installed")
    return os.path.join(next(iter(spec.submodule_search_locations)), "autorun")


def environment(base: dict[str, str], metrics_dir: str | None, settings: str | None
                ) -> dict[str, str]:
    """`base` with zero-code mode turned on; raises SettingsError for a bad settings line."""
    env = dict(base)
    here = autorun_dir()
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != here]
    env["PYTHONPATH"] = os.pathsep.join([here, *path])
    env[ENV_AUTO] = "1"
    if metrics_dir:
        env[ENV_DIR] = os.path.abspath(metrics_dir)
    if settings is not None:
        env[ENV_SETTINGS] = settings
    if env.get(ENV_SETTINGS, "").strip():
        parse(env[ENV_SETTINGS])
    return env


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    try:
        env = environment(dict(os.environ), args.metrics_dir, args.settings)
    except (SettingsError, RuntimeError) as e:
        print(f"dataloader-exporter run: error: {e}", file=sys.stderr)
        return 2
    if args.print_env:
        for key in ("PYTHONPATH", ENV_AUTO, ENV_DIR, ENV_SETTINGS):
            if env.get(key):
                print(f"{key}={shlex.quote(env[key])}")
        return 0
    if not command:
        print("dataloader-exporter run: error: no command given (… run -- COMMAND [ARGS...])",
              file=sys.stderr)
        return 2
    if not env.get(ENV_DIR):
        print(f"dataloader-exporter run: note: no --metrics-dir (or {ENV_DIR}): loaders are "
              "instrumented, but their metrics leave only through dataloader_exporter.serve()",
              file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        print(f"dataloader-exporter run: error: cannot run {command[0]!r}: {e}",
              file=sys.stderr)
        return 127
    return 0  # not reached
