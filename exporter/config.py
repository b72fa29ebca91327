"""Exporter configuration: flags and DATALOADER_EXPORTER_* variables -> one frozen dataclass.

Flags follow Prometheus habits (--web.listen-address, --collector.gpu / --no-collector.gpu).
Every flag has an environment variable; a flag wins over its variable. All problems are
reported together, in one message, before anything starts.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DEFAULT_PORT = 9478
DEFAULT_ADDRESS = f":{DEFAULT_PORT}"
DEFAULT_STALE_AFTER = 30.0
COLLECTORS = ("trainer", "gpu", "shm", "host")
LOG_LEVELS = ("debug", "info", "warn", "error")
ENV_PREFIX = "DATALOADER_EXPORTER_"
# The trainer and the sidecar read the same variable for the snapshot directory.
ENV_DIR = ENV_PREFIX + "DIR"


class ConfigError(ValueError):
    """One or more problems with flags or environment variables, one per line."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


@dataclass(frozen=True)
class Config:
    host: str
    port: int
    metrics_dir: str | None
    shm_path: str
    collectors: frozenset[str]
    stale_after: float
    log_level: str

    @property
    def listen_address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The serve command's flags; defaults are None so environment variables can fill in."""
    parser.add_argument("--web.listen-address", dest="listen_address", metavar="[HOST]:PORT",
                        help=f"address to serve on (default {DEFAULT_ADDRESS}; "
                             f"env {ENV_PREFIX}WEB_LISTEN_ADDRESS)")
    parser.add_argument("--metrics-dir", dest="metrics_dir", metavar="DIR",
                        help=f"directory of trainer snapshot files (env {ENV_DIR})")
    parser.add_argument("--shm-path", dest="shm_path", metavar="PATH",
                        help=f"shared-memory filesystem to watch (default /dev/shm; "
                             f"env {ENV_PREFIX}SHM_PATH)")
    parser.add_argument("--stale-after", dest="stale_after", metavar="SECONDS",
                        help=f"drop snapshot files not rewritten for this long (default "
                             f"{DEFAULT_STALE_AFTER:g}; env {ENV_PREFIX}STALE_AFTER)")
    parser.add_argument("--log.level", dest="log_level", metavar="LEVEL",
                        help=f"one of {', '.join(LOG_LEVELS)} (default info; "
                             f"env {ENV_PREFIX}LOG_LEVEL)")
    for name in COLLECTORS:
        parser.add_argument(f"--collector.{name}", dest=f"collector_{name}", default=None,
                            action=argparse.BooleanOptionalAction,
                            help=f"the {name} collector (env {ENV_PREFIX}COLLECTOR_"
                                 f"{name.upper()}=true|false)")


def _parse_bool(text: str) -> bool | None:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return None


def parse_address(text: str) -> tuple[str, int]:
    """'[HOST]:PORT' (IPv6 in brackets) -> (host, port); raises ValueError when bad."""
    text = text.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise ValueError(f"listen address {text!r} is not [HOST]:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"listen address {text!r}: put an IPv6 host in brackets")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"listen address {text!r}: port must be 0-65535")
    if any(c.isspace() for c in host):
        raise ValueError(f"listen address {text!r}: bad host")
    return host or "0.0.0.0", int(port_text)


def build(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Config:
    """Flags (winning) and environment variables -> Config, or ConfigError with all problems."""
    env = os.environ if env is None else env
    problems: list[str] = []

    def pick(attr: str, var: str) -> str | None:
        value = getattr(args, attr, None)
        return value if value is not None else env.get(ENV_PREFIX + var)

    address = pick("listen_address", "WEB_LISTEN_ADDRESS") or DEFAULT_ADDRESS
    host, port = "0.0.0.0", DEFAULT_PORT
    try:
        host, port = parse_address(address)
    except ValueError as e:
        problems.append(str(e))

    stale_text = pick("stale_after", "STALE_AFTER")
    stale_after = DEFAULT_STALE_AFTER
    if stale_text is not None:
        try:
            stale_after = float(stale_text)
            if not stale_after > 0 or stale_after == float("inf"):
                raise ValueError
        except ValueError:
            problems.append(f"--stale-after {stale_text!r}: must be a positive number of seconds")

    level = (pick("log_level", "LOG_LEVEL") or "info").lower()
    if level not in LOG_LEVELS:
        problems.append(f"--log.level {level!r}: must be one of {', '.join(LOG_LEVELS)}")

    metrics_dir = getattr(args, "metrics_dir", None) or env.get(ENV_DIR) or None
    shm_path = pick("shm_path", "SHM_PATH") or "/dev/shm"

    enabled = set()
    for name in COLLECTORS:
        flag = getattr(args, f"collector_{name}", None)
        if flag is None:
            raw = env.get(f"{ENV_PREFIX}COLLECTOR_{name.upper()}")
            flag = True if raw is None else _parse_bool(raw)
            if flag is None:
                problems.append(f"{ENV_PREFIX}COLLECTOR_{name.upper()}={raw!r}: "
                                "must be true or false")
                continue
            if name == "trainer" and raw is None and metrics_dir is None:
                flag = False  # nothing to read unless a directory is given
        if flag:
            enabled.add(name)

    if "trainer" in enabled:
        if metrics_dir is None:
            problems.append(f"the trainer collector needs --metrics-dir (or {ENV_DIR})")
        elif not os.path.isdir(metrics_dir):
            problems.append(f"--metrics-dir {metrics_dir!r}: no such directory")
        elif not os.access(metrics_dir, os.R_OK | os.X_OK):
            problems.append(f"--metrics-dir {metrics_dir!r}: not readable")

    if problems:
        raise ConfigError(problems)
    return Config(host, port, metrics_dir, shm_path, frozenset(enabled), stale_after, level)


def logging_level(name: str) -> int:
    return {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
            "error": logging.ERROR}[name]
