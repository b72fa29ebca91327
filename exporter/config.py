"""Exporter configuration: flags and DATALOADER_EXPORTER_* variables -> one frozen dataclass.

Flags follow Prometheus habits (--web.listen-address, --collector.gpu / --no-collector.gpu).
Every flag has an environment variable; a flag wins over its variable. All problems are
reported together, in one message, before anything starts.

The flags are one table, FLAGS (flag, variable, parser, default, help), as exporter-toolkit
declares its own; the collector switches come from the collector table,
exporter.sources.COLLECTORS. add_flags and build read both.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dataloader_exporter.core.envnames import DEFAULT_PORT, ENV_DIR, ENV_PREFIX
from dataloader_exporter.core.facts.shm import SHM_PATH
from dataloader_exporter.core.problems import Problems
from dataloader_exporter.core.settings import log_name
from dataloader_exporter.exporter.collectors.trainer import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_SERIES,
    DEFAULT_STALE_AFTER,
)
from dataloader_exporter.exporter.parsers import (
    parse_address,
    parse_bool,
    parse_count,
    parse_seconds,
)
from dataloader_exporter.exporter.snapshot_retention import (
    KEEP_FAILED_FILES,
    KEEP_FAILED_FOR,
    default_remove_after,
)
from dataloader_exporter.exporter.sources import COLLECTORS, SourceOptions
from dataloader_exporter.exporter.web.limits import Limits

if TYPE_CHECKING:
    from dataloader_exporter.exporter.web.webconfig import WebConfig

DEFAULT_ADDRESS = f":{DEFAULT_PORT}"
LOG_LEVELS = ("debug", "info", "warn", "error")


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

    @property
    def source_options(self) -> SourceOptions:
        """What the collectors are built from."""
        return SourceOptions(self.shm_path, self.metrics_dir, self.stale_after,
                             self.max_file_bytes, self.max_series, self.remove_after,
                             self.keep_failed_for)


@dataclass(frozen=True)
class Flag:
    """One flag of the serve command and its environment variable (a flag wins over it).

    parse turns the text into the value: None where the text means "not given" (an empty
    path or name), ValueError with the reason (the problem names the flag and the text) or
    Problems with whole lines. --help says "HELP (SHOWN; env VARIABLE)".
    """

    flag: str
    dest: str  # the argparse attribute, and the value's key in build()
    metavar: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    shown: str = ""  # how --help states the default; "" where it does not
    env: str = ""  # the variable where it is not ENV_PREFIX + the flag's name in capitals
    blank_is_unset: bool = False  # an empty flag leaves its variable to fill in

    @property
    def variable(self) -> str:
        name = self.flag.lstrip("-").replace(".", "_").replace("-", "_")
        return self.env or ENV_PREFIX + name.upper()

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        """The flag, its default None so that its variable can fill in."""
        said = f"{self.shown}; " if self.shown else ""
        parser.add_argument(self.flag, dest=self.dest, metavar=self.metavar,
                            help=f"{self.help} ({said}env {self.variable})")

    def text(self, args: argparse.Namespace, env: Mapping[str, str]) -> str | None:
        """The flag's text, else its variable's; None when neither is set."""
        value = getattr(args, self.dest, None)
        if value is None or (self.blank_is_unset and not value):
            return env.get(self.variable)
        return value

    def value(self, text: str | None, problems: list[str]) -> Any:
        """The parsed text, or the default (with the problem added when it is bad)."""
        if text is None:
            return self.default
        try:
            value = self.parse(text)
        except Problems as e:
            problems.extend(e.problems)
            return self.default
        except ValueError as e:
            problems.append(f"{self.flag} {log_name(text)!r}: {e}")
            return self.default
        return self.default if value is None else value


def _text(text: str) -> str | None:
    return text or None


def _address(text: str) -> tuple[str, int] | None:
    return parse_address(text) if text else None


def _remove_after(text: str) -> float:
    return math.inf if text.strip().lower() == "never" else parse_seconds(text)


def _level(text: str) -> str | None:
    level = text.lower()
    if level and level not in LOG_LEVELS:
        raise Problems(f"--log.level {log_name(level)!r}: must be one of "
                       f"{', '.join(LOG_LEVELS)}")
    return level or None


FLAGS: tuple[Flag, ...] = (
    Flag("--web.listen-address", "listen_address", "[HOST]:PORT", _address,
         ("0.0.0.0", DEFAULT_PORT), "address to serve on", f"default {DEFAULT_ADDRESS}"),
    Flag("--web.config.file", "web_config_file", "FILE", _text, None,
         "exporter-toolkit web configuration: TLS, client certificates, basic auth"),
    Flag("--web.max-connections", "max_connections", "N", parse_count, Limits.max_connections,
         "open connections at most; over it the longest-idle one is closed",
         f"default {Limits.max_connections}"),
    Flag("--web.read-header-timeout", "read_header_timeout", "DURATION", parse_seconds,
         Limits.read_header_timeout, "time a client has to send a request's headers",
         f"default {Limits.read_header_timeout:g}s"),
    Flag("--web.idle-timeout", "idle_timeout", "DURATION", parse_seconds, Limits.idle_timeout,
         "close a kept-alive connection idle this long", f"default {Limits.idle_timeout:g}s"),
    # The trainer writes where the same variable says.
    Flag("--metrics-dir", "metrics_dir", "DIR", _text, None,
         "directory of trainer snapshot files", env=ENV_DIR, blank_is_unset=True),
    Flag("--shm-path", "shm_path", "PATH", _text, SHM_PATH,
         "shared-memory filesystem to watch", f"default {SHM_PATH}"),
    Flag("--stale-after", "stale_after", "SECONDS", parse_seconds, DEFAULT_STALE_AFTER,
         "drop snapshot files not rewritten for this long", f"default {DEFAULT_STALE_AFTER:g}"),
    Flag("--collector.trainer.max-file-bytes", "max_file_bytes", "BYTES", parse_count,
         DEFAULT_MAX_FILE_BYTES, "skip (and count) snapshot files larger than this",
         f"default {DEFAULT_MAX_FILE_BYTES}"),
    Flag("--collector.trainer.max-series", "max_series", "N", parse_count, DEFAULT_MAX_SERIES,
         "skip (and count) snapshot files with more series", f"default {DEFAULT_MAX_SERIES}"),
    Flag("--collector.trainer.remove-after", "remove_after", "DURATION", _remove_after, None,
         "delete snapshot files not rewritten for this long, or 'never'",
         f"default: 10 x --stale-after, at least {default_remove_after(0):g}s"),
    Flag("--collector.trainer.keep-failed-for", "keep_failed_for", "DURATION", parse_seconds,
         KEEP_FAILED_FOR, "keep the last snapshot of a run that ended badly (killed, a lost "
         f"worker, a failure) this long instead, the newest {KEEP_FAILED_FILES} of them",
         f"default {KEEP_FAILED_FOR:g}s: 7 days"),
    Flag("--log.level", "log_level", "LEVEL", _level, "info",
         f"one of {', '.join(LOG_LEVELS)}", "default info"),
)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The serve command's flags, then a switch per collector; defaults are None so
    environment variables can fill in."""
    for flag in FLAGS:
        flag.add_to(parser)
    for c in COLLECTORS:
        parser.add_argument(c.flag, dest=c.dest, default=None,
                            action=argparse.BooleanOptionalAction,
                            help=f"{c.help} (env {c.variable}=true|false)")


def build(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Config:
    """Flags (winning) and environment variables -> Config, or ConfigError with all problems."""
    env = os.environ if env is None else env
    problems: list[str] = []
    texts = {flag.dest: flag.text(args, env) for flag in FLAGS}
    v = {flag.dest: flag.value(texts[flag.dest], problems) for flag in FLAGS}
    if v["remove_after"] is not None and v["remove_after"] < v["stale_after"]:
        problems.append(f"--collector.trainer.remove-after {texts['remove_after']!r}: must not "
                        f"be shorter than --stale-after ({v['stale_after']:g}s)")
    web = _load_web(v["web_config_file"], problems)
    enabled = _switches(args, env, v["metrics_dir"], problems)
    for c in COLLECTORS:
        if c.needs_dir and c.name in enabled:
            problems += _dir_problems(c.name, v["metrics_dir"])
    if problems:
        raise ConfigError(problems)
    host, port = v["listen_address"]
    limits = Limits(v["max_connections"], v["read_header_timeout"], v["idle_timeout"],
                    Limits.write_timeout)
    return Config(host, port, v["metrics_dir"], v["shm_path"], frozenset(enabled),
                  v["stale_after"], v["log_level"], limits, v["web_config_file"], web,
                  v["max_file_bytes"], v["max_series"], v["remove_after"], v["keep_failed_for"])


def _load_web(path: str | None, problems: list[str]) -> WebConfig | None:
    """The web configuration file loaded and checked; None without one (or when bad)."""
    if path is None:
        return None
    from dataloader_exporter.exporter.web import (
        webconfig,  # PyYAML and bcrypt load only when asked for
    )

    try:
        return webconfig.load(path)
    except webconfig.WebConfigError as e:
        problems.extend(f"--web.config.file: {p}" for p in e.problems)
        return None


def _switches(args: argparse.Namespace, env: Mapping[str, str], metrics_dir: str | None,
              problems: list[str]) -> set[str]:
    """The collectors switched on: by flag, else by variable, else by the table's default."""
    enabled = set()
    for c in COLLECTORS:
        on = getattr(args, c.dest, None)
        if on is None:
            raw = env.get(c.variable)
            if raw is None:  # one that reads the snapshot directory: only when given one
                on = c.default and (metrics_dir is not None or not c.needs_dir)
            elif (on := parse_bool(raw)) is None:
                problems.append(f"{c.variable}={raw!r}: must be true or false")
                continue
        if on:
            enabled.add(c.name)
    return enabled


def _dir_problems(name: str, metrics_dir: str | None) -> list[str]:
    """Why the snapshot directory cannot be read by collector `name`; [] when it can."""
    if metrics_dir is None:
        return [f"the {name} collector needs --metrics-dir (or {ENV_DIR})"]
    if not os.path.exists(metrics_dir):
        return [f"--metrics-dir {metrics_dir!r}: no such directory"]
    if not os.path.isdir(metrics_dir):
        return [f"--metrics-dir {metrics_dir!r}: not a directory"]
    if not os.access(metrics_dir, os.R_OK | os.X_OK):
        return [f"--metrics-dir {metrics_dir!r}: not readable"]
    return []


def logging_level(name: str) -> int:
    return {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
            "error": logging.ERROR}[name]
