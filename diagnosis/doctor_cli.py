"""`dataloader-exporter doctor`: read the metrics, print the diagnosis, exit 0/1/2."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

from dataloader_exporter.diagnosis import dirsource, promsource
from dataloader_exporter.diagnosis.machine import local_machine
from dataloader_exporter.diagnosis.report import Report, env_line
from dataloader_exporter.diagnosis.report import build_report as report_of
from dataloader_exporter.diagnosis.signals import Scrape, Window, loaders, window_of

EXIT_HEALTHY, EXIT_PROBLEMS, EXIT_UNREADABLE = 0, 1, 2


DESCRIPTION = ("Reads the metrics twice (--url), over a time range (--prometheus) or from "
               "the trainer's snapshot files (--metrics-dir; a run that has ended is read "
               "whole), adds this machine's facts, and prints a diagnosis per loader and "
               "rank. Exit status: 0 healthy, 1 problems found, 2 the metrics could not be "
               "read.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="an exporter's /metrics URL (scraped twice)")
    src.add_argument("--prometheus", metavar="URL", help="a Prometheus server's base URL")
    src.add_argument("--metrics-dir", metavar="DIR",
                     help="a directory of the trainer's snapshot files (*.prom), live or "
                          "from a run that has ended; no file is deleted")
    p.add_argument("--interval", type=float, default=10.0,
                   help="seconds between the two reads of --url or of a live --metrics-dir "
                        "(default 10)")
    p.add_argument("--range", type=float, default=600.0, dest="range_seconds",
                   help="seconds of history to read from --prometheus (default 600)")
    p.add_argument("--match", default="", help="label matchers for --prometheus, e.g. "
                                                 "'job=\"train\"'")
    p.add_argument("--data-path", default=".", help="where the training data lives, to tell "
                                                     "its storage type (default .)")
    p.add_argument("--local-ranks", type=int, default=0,
                   help="training processes per machine (default: the ranks each exporter "
                        "instance reports)")
    p.add_argument("--format", choices=("text", "json", "env"), default="text",
                   help="text (default), json, or env: the settings advice as one "
                        "DATALOADER_EXPORTER_SETTINGS=... line for a ConfigMap or env file")


def build_report(window: Window, source: str, data_path: str = ".",
                 local_ranks: int = 0) -> Report:
    """The report over a window; local_ranks 0: as the window says (per exporter instance
    from Prometheus; every rank of a scraped exporter, or of one directory, shares its
    machine)."""
    sigs = loaders(window)
    ranks: dict[str, int] | int = local_ranks or window.local_ranks or len(
        {s.rank for s in sigs})
    return report_of(source, local_machine(data_path), sigs, ranks, window.is_whole_run)


def scrape_window(url: str, interval: float,
                  sleep: Callable[[float], None] = time.sleep) -> Window:
    """Two scrapes `interval` apart; the whole run from the second when the run has ended
    between them: a sidecar whose newest snapshot file is no longer written
    (signals.window_of; an in-process server lives as long as its run)."""
    first = Scrape.fetch(url)
    sleep(interval)
    second = Scrape.fetch(url)
    return window_of(first, second, dirsource.ended(second))


def read(args: argparse.Namespace) -> tuple[Window, str]:
    """The window from the source the flags name, and the line that describes it; raises
    OSError or ValueError when the metrics cannot be read."""
    if args.url:
        window = scrape_window(args.url, args.interval)
        if window.is_whole_run:
            return window, (f"{args.url}, whole run (no batch in {args.interval:g} s between "
                            f"scrapes: the run has ended): {dirsource.WHOLE_RUN}")
        return window, f"{args.url}, {args.interval:g} s between scrapes"
    if args.metrics_dir:
        snapshots = dirsource.SnapshotDir(args.metrics_dir)
        window, source = dirsource.window(snapshots, args.interval)
        if snapshots.skipped:
            print(f"dataloader-exporter doctor: skipped {snapshots.describe_skipped()}; read "
                  "the others", file=sys.stderr)
        if snapshots.earlier:
            print(f"dataloader-exporter doctor: left out {snapshots.earlier} file"
                  f"{'s' if snapshots.earlier > 1 else ''} written more than "
                  f"{dirsource.RUN_SPAN:g} s before the newest (an earlier run)",
                  file=sys.stderr)
        return window, source
    return (promsource.window(args.prometheus, args.range_seconds, args.match),
            f"{args.prometheus}, last {args.range_seconds:g} s")


def run(args: argparse.Namespace) -> int:
    if args.interval <= 0 or args.range_seconds <= 0 or args.local_ranks < 0:
        print("dataloader-exporter doctor: --interval, --range and --local-ranks must be "
              "positive", file=sys.stderr)
        return EXIT_UNREADABLE
    try:
        window, source = read(args)
    except (OSError, ValueError) as e:
        print(f"dataloader-exporter doctor: cannot read the metrics: {e}", file=sys.stderr)
        return EXIT_UNREADABLE
    report = build_report(window, source, args.data_path, args.local_ranks)
    if not report.diagnoses:
        print(f"dataloader-exporter doctor: no DataLoader metrics at {source}", file=sys.stderr)
        return EXIT_UNREADABLE
    if args.format == "json":
        print(json.dumps(report.as_dict(), indent=2, sort_keys=True))
    elif args.format == "env":  # a setting to apply, not a verdict: 0 once it is printed
        line, skipped = env_line(report)
        for name in skipped:
            print(f"dataloader-exporter doctor: loader {name!r} left out: its name cannot be "
                  "written in DATALOADER_EXPORTER_SETTINGS (letters, digits, _ . : -)",
                  file=sys.stderr)
        print(line)
        return EXIT_HEALTHY
    else:
        print(report.text(), end="")
    return EXIT_HEALTHY if report.healthy else EXIT_PROBLEMS
