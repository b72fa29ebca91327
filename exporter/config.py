"""Exporter configuration: flags and DATALOADER_EXPORTER_* variables -> one frozen dataclass.

Flags follow Prometheus habits (--web.listen-address, --collector.gpu / --no-collector.gpu).
Every flag has an environment variable; a flag wins over its variable. All problems are
reported together, in one message, before anything starts.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dataloader_exporter.core.env import ENV_DIR, ENV_PREFIX
from dataloader_exporter.core.facts.shm import SHM_PATH
from dataloader_exporter.core.problems import Problems
from dataloader_exporter.core.settings import log_name
from dataloader_exporter.exporter.collectors.trainer import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_SERIES,
    DEFAULT_STALE_AFTER,
    KEEP_FAILED_FILES,
    KEEP_FAILED_FOR,
    default_remove_after,
)
from dataloader_exporter.exporter.http import Limits

if TYPE_CHECKING:
    from dataloader_exporter.exporter.webconfig import WebConfig

DEFAULT_PORT = 9478
DEFAULT_ADDRESS = f":{DEFAULT_PORT}"
COLLECTORS = ("trainer", "gpu", "shm", "host")
LOG_LEVELS = ("debug", "info", "warn", "error")
# The trainer and the sidecar read the same variable for the snapshot directory.


class ConfigError(Problems):
    """One or more problems with flags or environment variables, one per line."""


@dataclass(frozen=True)
class Config:
    host: str
    port: int
    metrics_dir: str | None
    shm_path: str
    collectors: frozenset[str]
    stale_after: float
    log_level: str
    limits: Limits = field(default_factory=Limits)
    web_config_file: str | None = None
    web: WebConfig | None = None  # loaded and checked from web_config_file
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    max_series: int = DEFAULT_MAX_SERIES
    remove_after: float | None = None  # None: default_remove_after(stale_after)
    keep_failed_for: float = KEEP_FAILED_FOR

    @property
    def listen_address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The serve command's flags; defaults are None so environment variables can fill in."""
    parser.add_argument("--web.listen-address", dest="listen_address", metavar="[HOST]:PORT",
                        help=f"address to serve on (default {DEFAULT_ADDRESS}; "
                             f"env {ENV_PREFIX}WEB_LISTEN_ADDRESS)")
    parser.add_argument("--web.config.file", dest="web_config_file", metavar="FILE",
                        help="exporter-toolkit web configuration: TLS, client certificates, "
                             f"basic auth (env {ENV_PREFIX}WEB_CONFIG_FILE)")
    parser.add_argument("--web.max-connections", dest="max_connections", metavar="N",
                        help=f"open connections at most; over it the longest-idle one is "
                             f"closed (default {Limits.max_connections}; "
                             f"env {ENV_PREFIX}WEB_MAX_CONNECTIONS)")
    parser.add_argument("--web.read-header-timeout", dest="read_header_timeout",
                        metavar="DURATION",
                        help=f"time a client has to send a request's headers (default "
                             f"{Limits.read_header_timeout:g}s; "
                             f"env {ENV_PREFIX}WEB_READ_HEADER_TIMEOUT)")
    parser.add_argument("--web.idle-timeout", dest="idle_timeout", metavar="DURATION",
                        help=f"close a kept-alive connection idle this long (default "
                             f"{Limits.idle_timeout:g}s; env {ENV_PREFIX}WEB_IDLE_TIMEOUT)")
    parser.add_argument("--metrics-dir", dest="metrics_dir", metavar="DIR",
                        help=f"directory of trainer snapshot files (env {ENV_DIR})")
    parser.add_argument("--shm-path", dest="shm_path", metavar="PATH",
                        help=f"shared-memory filesystem to watch (default /dev/shm; "
                             f"env {ENV_PREFIX}SHM_PATH)")
    parser.add_argument("--stale-after", dest="stale_after", metavar="SECONDS",
                        help=f"drop snapshot files not rewritten for this long (default "
                             f"{DEFAULT_STALE_AFTER:g}; env {ENV_PREFIX}STALE_AFTER)")
    parser.add_argument("--collector.trainer.max-file-bytes", dest="max_file_bytes",
                        metavar="BYTES",
                        help=f"skip (and count) snapshot files larger than this (default "
                             f"{DEFAULT_MAX_FILE_BYTES}; env "
                             f"{ENV_PREFIX}COLLECTOR_TRAINER_MAX_FILE_BYTES)")
    parser.add_argument("--collector.trainer.max-series", dest="max_series", metavar="N",
                        help=f"skip (and count) snapshot files with more series (default "
                             f"{DEFAULT_MAX_SERIES}; env "
                             f"{ENV_PREFIX}COLLECTOR_TRAINER_MAX_SERIES)")
    parser.add_argument("--collector.trainer.remove-after", dest="remove_after",
                        metavar="DURATION",
                        help="delete snapshot files not rewritten for this long, or 'never' "
                             f"(default: 10 x --stale-after, at least "
                             f"{default_remove_after(0):g}s; env "
                             f"{ENV_PREFIX}COLLECTOR_TRAINER_REMOVE_AFTER)")
    parser.add_argument("--collector.trainer.keep-failed-for", dest="keep_failed_for",
                        metavar="DURATION",
                        help="keep the last snapshot of a run that ended badly (killed, a "
                             "lost worker, a failure) this long instead, the newest "
                             f"{KEEP_FAILED_FILES} of them (default {KEEP_FAILED_FOR:g}s: 7 "
                             f"days; env {ENV_PREFIX}COLLECTOR_TRAINER_KEEP_FAILED_FOR)")
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


_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d|w)?")  # ASCII: float() reads '\u0663'
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0,
         None: 1.0}
_MAX_DIGITS = 18  # a count or a duration longer than this is a typo (and int() of 100 kB is slow)


def parse_seconds(text: str) -> float:
    """'30', '30s', '1.5m', '500ms', '7d', '1w' -> seconds (positive, finite); ValueError
    otherwise."""
    m = _DURATION.fullmatch(text.strip())
    if m is None or len(m.group(1)) > _MAX_DIGITS:
        raise ValueError(text)
    seconds = float(m.group(1)) * _UNIT[m.group(2)]
    if not 0 < seconds < math.inf:
        raise ValueError(text)
    return seconds


_LABEL = re.compile(r"[A-Za-z0-9_-]{1,63}")  # a DNS label (RFC 1035), '_' as /etc/hosts allows
_MAX_NAME = 253  # a DNS name's longest text form: 255 octets on the wire (RFC 1035 2.3.4)


def _host_problem(host: str, bracketed: bool) -> str | None:
    """Why a listen host cannot be an address or a host name; None when it can.

    Checked here so that the resolver (whose IDNA codec raises UnicodeError for a label
    over 63 characters) only ever sees names it can look up; whether the name resolves is
    the bind's to say.
    """
    if bracketed:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return "brackets hold an IPv6 address only"
        return None
    if not host.isascii():
        return "the host must be ASCII (write an internationalized name in its xn-- form)"
    with contextlib.suppress(ValueError):
        ipaddress.IPv4Address(host)
        return None
    name = host.removesuffix(".")
    if len(name) > _MAX_NAME:
        return f"the host name is {len(name)} characters, over {_MAX_NAME}"
    for label in name.split("."):
        if len(label) > 63:
            return f"the host label {log_name(label)!r} is longer than 63 characters"
        if not _LABEL.fullmatch(label):
            return (f"bad host {log_name(host)!r}: each dot-separated label is 1 to 63 "
                    "letters, digits, '-' or '_'")
    return None


def parse_address(text: str) -> tuple[str, int]:
    """'[HOST]:PORT' (IPv6 in brackets) -> (host, port); raises ValueError when bad.

    An empty host is every IPv4 interface; '[::]' every IPv6 one."""
    text = text.strip()
    shown = repr(log_name(text))
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise ValueError(f"listen address {shown} is not [HOST]:PORT")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"listen address {shown}: put an IPv6 host in brackets")
    if not (port_text.isascii() and port_text.isdecimal()) or len(port_text) > 5 or not (
            0 <= int(port_text) <= 65535):
        raise ValueError(f"listen address {shown}: port must be 0-65535")
    problem = _host_problem(host, bracketed) if host or bracketed else None
    if problem is not None:
        raise ValueError(f"listen address {shown}: {problem}")
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

    def seconds(attr: str, var: str, flag: str, default: float) -> float:
        text = pick(attr, var)
        if text is None:
            return default
        try:
            return parse_seconds(text)
        except ValueError:
            problems.append(f"{flag} {log_name(text)!r}: must be a positive duration (30, 30s, "
                            "2m)")
            return default

    def count(attr: str, var: str, flag: str, default: int) -> int:
        text = pick(attr, var)
        if text is None:
            return default
        digits = text.strip()
        if digits.isascii() and digits.isdecimal() and len(digits) <= _MAX_DIGITS and int(
                digits) > 0:
            return int(digits)
        problems.append(f"{flag} {log_name(text)!r}: must be a positive whole number")
        return default

    stale_after = seconds("stale_after", "STALE_AFTER", "--stale-after", DEFAULT_STALE_AFTER)
    defaults = Limits()
    read_header = seconds("read_header_timeout", "WEB_READ_HEADER_TIMEOUT",
                          "--web.read-header-timeout", defaults.read_header_timeout)
    idle = seconds("idle_timeout", "WEB_IDLE_TIMEOUT", "--web.idle-timeout",
                   defaults.idle_timeout)
    max_connections = count("max_connections", "WEB_MAX_CONNECTIONS", "--web.max-connections",
                            defaults.max_connections)
    limits = Limits(max_connections, read_header, idle, defaults.write_timeout)

    max_file_bytes = count("max_file_bytes", "COLLECTOR_TRAINER_MAX_FILE_BYTES",
                           "--collector.trainer.max-file-bytes", DEFAULT_MAX_FILE_BYTES)
    max_series = count("max_series", "COLLECTOR_TRAINER_MAX_SERIES",
                       "--collector.trainer.max-series", DEFAULT_MAX_SERIES)
    remove_text = pick("remove_after", "COLLECTOR_TRAINER_REMOVE_AFTER")
    remove_after: float | None = None
    if remove_text is not None and remove_text.strip().lower() == "never":
        remove_after = float("inf")
    elif remove_text is not None:
        remove_after = seconds("remove_after", "COLLECTOR_TRAINER_REMOVE_AFTER",
                               "--collector.trainer.remove-after", stale_after)
        if remove_after < stale_after:
            problems.append(f"--collector.trainer.remove-after {remove_text!r}: must not be "
                            f"shorter than --stale-after ({stale_after:g}s)")

    keep_failed_for = seconds("keep_failed_for", "COLLECTOR_TRAINER_KEEP_FAILED_FOR",
                              "--collector.trainer.keep-failed-for", KEEP_FAILED_FOR)

    web_file = pick("web_config_file", "WEB_CONFIG_FILE") or None
    web = None
    if web_file is not None:
        from dataloader_exporter.exporter import (
            webconfig,  # PyYAML and bcrypt load only when asked for
        )

        try:
            web = webconfig.load(web_file)
        except webconfig.WebConfigError as e:
            problems += [f"--web.config.file: {p}" for p in e.problems]

    level = (pick("log_level", "LOG_LEVEL") or "info").lower()
    if level not in LOG_LEVELS:
        problems.append(f"--log.level {log_name(level)!r}: must be one of {', '.join(LOG_LEVELS)}")

    metrics_dir = getattr(args, "metrics_dir", None) or env.get(ENV_DIR) or None
    shm_path = pick("shm_path", "SHM_PATH") or SHM_PATH

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
        elif not os.path.exists(metrics_dir):
            problems.append(f"--metrics-dir {metrics_dir!r}: no such directory")
        elif not os.path.isdir(metrics_dir):
            problems.append(f"--metrics-dir {metrics_dir!r}: not a directory")
        elif not os.access(metrics_dir, os.R_OK | os.X_OK):
            problems.append(f"--metrics-dir {metrics_dir!r}: not readable")

    if problems:
        raise ConfigError(problems)
    return Config(host, port, metrics_dir, shm_path, frozenset(enabled), stale_after, level,
                  limits, web_file, web, max_file_bytes, max_series, remove_after,
                  keep_failed_for)


def logging_level(name: str) -> int:
    return {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
            "error": logging.ERROR}[name]
