"""`dataloader-exporter serve`: flags -> config -> registry -> serve, until SIGTERM."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from dataloader_exporter import __version__
from dataloader_exporter.core.settings import log_name
from dataloader_exporter.exporter import config
from dataloader_exporter.exporter.sources import attach, build_sources
from dataloader_exporter.exporter.web.server import ServerHandle, serve

log = logging.getLogger("dataloader_exporter.exporter")


DESCRIPTION = ("Serve trainer snapshot files together with GPU, /dev/shm and host metrics "
               "(the sidecar), over HTTP or TLS.")
REPORTS_UNKNOWN_FLAGS = True  # reported with the configuration's problems, all at once


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config.add_flags(parser)


def run(args: argparse.Namespace) -> int:
    return run_serve(args, getattr(args, "unknown_flags", []))


def _fail(problems: Sequence[str], hint: str = " (see `dataloader-exporter serve --help`)"
          ) -> int:
    """One line per problem on stderr, the last with the hint; exit status 2."""
    for i, p in enumerate(problems, 1):
        print(f"dataloader-exporter: error: {p}{hint if i == len(problems) else ''}",
              file=sys.stderr)
    return 2


def bound_address(handle: ServerHandle) -> str:
    """The address a server is bound to, as a log line says it: a wildcard address is
    named as such (every IPv4 or IPv6 interface), never as the loopback a client would use."""
    host = f"[{handle.host}]" if ":" in handle.host else handle.host
    address = f"{handle.scheme}://{host}:{handle.port}"
    wildcard = {"0.0.0.0": " (every IPv4 interface)", "::": " (every IPv6 interface)"}
    return address + wildcard.get(handle.host, "")  # asyncio binds '::' IPv6-only


def run_serve(args: argparse.Namespace, unknown: Sequence[str]) -> int:
    problems = [f"unknown flag {u!r}" for u in unknown]
    try:
        cfg = config.build(args)
    except config.ConfigError as e:
        problems += e.problems
        cfg = None
    if problems or cfg is None:
        return _fail(problems)
    logging.basicConfig(level=config.logging_level(cfg.log_level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    registry = CollectorRegistry()
    sources = build_sources(cfg.collectors, cfg.source_options)
    supervisor = attach(registry, sources)
    try:
        handle = serve(registry, cfg.host, cfg.port, cfg.web, cfg.limits)
    except (OSError, UnicodeError) as e:  # in use, cannot assign, no such name, ...
        return _fail([f"cannot listen on {log_name(cfg.listen_address)}: "
                      f"{getattr(e, 'strerror', None) or e}"], hint="")
    # One collection in the background right away: NVML's first init can take longer than
    # a scrape may wait, and the snapshot files get parsed before the first scrape.
    threading.Thread(target=lambda: list(registry.collect()), name="warm-up",
                     daemon=True).start()
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()  # nothing else here: a signal handler must not take locks

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info("dataloader-exporter %s listening on %s (collectors: %s%s)", __version__,
             bound_address(handle), ", ".join(s.name for s in sources) or "none",
             "; basic auth" if cfg.web is not None and cfg.web.users else "")
    stop.wait()
    log.info("shutting down")
    handle.shutdown()
    supervisor.close()
    return 0
