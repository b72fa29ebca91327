"""The dataloader-exporter command: flags -> config -> registry -> serve."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from exporter import __version__, config, doctor_cli, top
from exporter.collectors.trainer import TrainerCollector
from exporter.http import serve
from exporter.sources import attach, system_sources

log = logging.getLogger("exporter")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dataloader-exporter",
        description="Prometheus exporter for PyTorch DataLoader, GPU, /dev/shm and host metrics.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve_p = sub.add_parser("serve", help="serve /metrics (sidecar mode)",
                             description="Serve trainer snapshot files together with GPU, "
                                         "/dev/shm and host metrics.")
    config.add_flags(serve_p)
    doctor_cli.add_parser(sub)
    top.add_parser(sub)
    _add_demo(sub)
    dash_p = sub.add_parser("dashboards", help="write Grafana dashboards, alerts and rules",
                            description="Write the Grafana dashboards and provisioning files "
                                        "and the Prometheus alert rules into a directory.")
    dash_p.add_argument("--out", default="deploy", metavar="DIR",
                        help="output directory (default: %(default)s)")
    return parser


def _add_demo(sub: argparse._SubParsersAction) -> None:
    """The demo needs torch, which the exporter never imports: its flags live here."""
    p = sub.add_parser("demo", help="a starved and a tuned CPU training run, side by side "
                                    "(needs the torch extra)")
    p.add_argument("--duration", type=float, default=60.0,
                   help="seconds of training in all, split between the two runs (default 60)")
    p.add_argument("--port", type=int, default=9478,
                   help="serve /metrics on 127.0.0.1:PORT meanwhile (0: any free port)")
    p.add_argument("--samples", type=int, default=1024, help="samples per epoch")
    p.add_argument("--keep-serving", action="store_true",
                   help="keep serving /metrics after the runs, until Ctrl-C")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "serve":
        return run_serve(args, unknown)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "doctor":
        return doctor_cli.run(args)
    if args.command == "demo":
        from instrument import demo

        return demo.run(args)
    if args.command == "top":
        return top.run(args)
    if args.command == "dashboards":
        return run_dashboards(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


def _fail(problems: Sequence[str]) -> int:
    for p in problems:
        print(f"dataloader-exporter: error: {p}", file=sys.stderr)
    print("dataloader-exporter: see `dataloader-exporter serve --help`", file=sys.stderr)
    return 2


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
    sources = system_sources(cfg.shm_path, gpu="gpu" in cfg.collectors,
                             shm="shm" in cfg.collectors, host="host" in cfg.collectors)
    if "trainer" in cfg.collectors and cfg.metrics_dir is not None:
        sources.insert(0, TrainerCollector(cfg.metrics_dir, cfg.stale_after))
    supervisor = attach(registry, sources)
    try:
        handle = serve(registry, cfg.host, cfg.port, cfg.web, cfg.limits)
    except OSError as e:
        return _fail([f"cannot listen on {cfg.listen_address}: {e.strerror or e}"])
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
             handle.url, ", ".join(s.name for s in sources) or "none",
             "; basic auth" if cfg.web is not None and cfg.web.users else "")
    stop.wait()
    log.info("shutting down")
    handle.shutdown()
    supervisor.close()
    return 0


def run_dashboards(args: argparse.Namespace) -> int:
    """Writes the generated dashboards, provisioning and rules; grafanalib loads only here."""
    try:
        from dashboards.build import write
    except ImportError as e:
        print(f"dataloader-exporter: error: {e}; install the dashboards extra "
              "(pip install 'dataloader-exporter[dashboards]')", file=sys.stderr)
        return 2
    for path in write(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
