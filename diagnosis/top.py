"""`dataloader-exporter top`: a live terminal view of the overview dashboard's signals.

Computed from successive scrapes of an exporter's /metrics; needs no Prometheus or
Grafana. A loader whose workers' private memory grows (diagnosis.memgrowth) gets a line
under its row with the growth per worker and the dataset attribute that holds it. Quits
on q and on Ctrl-C, also where it was started with SIGINT ignored (a background job of a
script without job control inherits that), as a terminal view should.
"""

from __future__ import annotations

import argparse
import contextlib
import curses
import signal
import sys
import time
from collections.abc import Sequence

from dataloader_exporter.diagnosis import memgrowth
from dataloader_exporter.diagnosis.signals import LoaderSignals, Scrape, Window, loaders

HEADER = (f"{'LOADER':<16} {'RANK':>4} {'STALL':>6} {'FETCH P95':>10} {'BATCH/S':>8} "
          f"{'SAMPLE/S':>9} {'WORKERS':>8} {'SHM':>5} {'GPU':>5}")


DESCRIPTION = ("A live terminal view of an exporter's DataLoader metrics, from successive "
               "scrapes of its /metrics (needs a terminal; `dataloader-exporter doctor` "
               "prints a report anywhere).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="an exporter's /metrics URL")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def row(s: LoaderSignals) -> str:
    p95 = "-" if s.fetch_p95 is None else f"{s.fetch_p95 * 1000:.1f} ms"
    per_s = s.samples_per_second
    samples = "-" if per_s is None else f"{per_s:.0f}"  # unknown, not 0
    workers = "-" if s.workers_configured is None else (
        f"{s.workers_active or 0:.0f}/{s.workers_configured:.0f}")
    return (f"{s.loader[:16]:<16} {s.rank:>4} {_pct(s.stall_share):>6} {p95:>10} "
            f"{s.batches_per_second:>8.1f} {samples:>9} {workers:>8} "
            f"{_pct(s.shm_fill):>5} {_pct(s.gpu_utilization):>5}")


def render(signals: Sequence[LoaderSignals], source: str, status: str = "") -> list[str]:
    """The lines of one frame (pure, so tests can feed it real scrapes)."""
    lines = [f"dataloader-exporter top - {source} - {time.strftime('%H:%M:%S')}   q: quit",
             status or "", HEADER]
    if not signals:
        lines.append("(no DataLoader metrics yet)")
    for s in signals:
        growth = memgrowth.top_line(s)
        lines += [row(s), *([growth] if growth else [])]
    return lines


def _draw(screen: curses.window, lines: list[str]) -> None:
    screen.erase()
    height, width = screen.getmaxyx()
    for y, line in enumerate(lines[: height - 1]):
        attr = curses.A_BOLD if y in (0, 2) else curses.A_NORMAL
        screen.addnstr(y, 0, line, max(0, width - 1), attr)
    screen.refresh()


def _loop(screen: curses.window, url: str, interval: float) -> None:
    curses.curs_set(0)
    screen.timeout(100)
    previous: Scrape | None = None
    signals: list[LoaderSignals] = []
    status = "waiting for a second scrape..."
    next_at = 0.0
    while True:
        now = time.monotonic()
        if now >= next_at:
            next_at = now + interval
            try:
                current = Scrape.fetch(url, timeout=max(1.0, interval))
                if previous is not None:
                    signals = loaders(Window.between(previous, current))
                    status = ""
                previous = current
            except (OSError, ValueError) as e:
                status = f"cannot scrape {url}: {e}"
            _draw(screen, render(signals, url, status))
        key = screen.getch()
        if key in (ord("q"), ord("Q")):
            return


def run(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        print("dataloader-exporter top: --interval must be positive", file=sys.stderr)
        return 2
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        print("dataloader-exporter top: needs a terminal; without one, use "
              f"`dataloader-exporter doctor --url {args.url}`", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if it was ignored
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C quits like q
        curses.wrapper(_loop, args.url, args.interval)
    return 0
