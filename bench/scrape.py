"""Scrape latency, RSS, start-up time and CPU of the exporter, as separate processes.

Set-up: 8 ranks x 4 loaders of real snapshot files (one registry per rank, instrument.
DataLoader, generate_latest; bench/_snapshots.py) and a fake 8-GPU NVML. The real CLI
can only use the real pynvml, so the full set (trainer, gpu, shm, host) runs through
bench/_exporter_with_fake_nvml.py, which builds the same registry the CLI builds.

  fake-GPU exporter  start-up (Popen to the first 200 on /metrics); sequential scrapes
                     on fresh connections after a warm-up: p50/p99/max, exposition size
                     and series; RSS after the scrapes; CPU (user+system of the process)
                     over ~10 s of one scrape a second, in percent of one core; and each
                     collector's time, from the exporter's own collector_duration gauge.
  real CLI           `python -m dataloader_exporter serve --no-collector.gpu` over the files:
                     start-up (median of 3 starts), some scrapes, RSS after them.

  load (fake-GPU)    50 concurrent clients, 5,000 scrapes on fresh connections: errors,
                     p50/p99, the sidecar's CPU per scrape and per collection (it counts
                     its collections: concurrent scrapes share one), RSS after the load;
                     then 1,000 idle connections: a new scrape's latency, the process's
                     threads and open descriptors.

Scrapes ask for OpenMetrics, as Prometheus does. While it runs, the snapshot files are
touched every second, as live trainers rewrite them, so the exporter re-reads them.
There are 32 rank files: 8 written by real loaders, cloned to ranks 8-31.

Targets: p99 <= 20 ms (one client), RSS <= 40 MB (10^6 bytes), start-up < 1 s; under
load: 0 errors, p99 <= 0.5 s, CPU <= 10 ms a scrape, RSS <= 40 MB; with 1,000 idle
connections a scrape answers within 1 s.

    python bench/scrape.py [--quick] [--strict]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _served import REPO, Served, free_port, percentile, rounded, series
from _snapshots import LOADERS, write_rank_files

from dataloader_exporter.core import catalogue as cat

WRITTEN, RANKS, GPUS, STALE_AFTER = 8, 32, 8, "86400"  # files stay fresh for the run
P99_MS, RSS_MB, START_S = 20.0, 40.0, 1.0
LOAD_P99_S, LOAD_CPU_MS, IDLE_SCRAPE_S = 0.5, 10.0, 1.0
_DURATION = re.compile(
    rf'^{cat.COLLECTOR_DURATION.name}\{{collector="(\w+)"\}} (\S+)$'.encode(), re.M)
_COLLECTIONS = re.compile(rf"^{cat.COLLECTIONS.name} (\S+)$".encode(), re.M)


@dataclass
class Plan:
    warmup: int
    scrapes: int  # at most this many timed scrapes ...
    budget_s: float  # ... or as many as fit in this time
    cpu_seconds: int
    cli_starts: int
    cli_scrapes: int
    cli_budget_s: float
    clients: int
    load_scrapes: int
    idle_connections: int


PLANS = {False: Plan(20, 1000, 30.0, 10, 3, 200, 8.0, 50, 5000, 1000),
         True: Plan(5, 150, 6.0, 3, 1, 30, 2.0, 20, 400, 200)}


@dataclass
class LoadRun:
    clients: int
    scrapes: int
    errors: int
    p50_s: float
    p99_s: float
    cpu_ms_per_scrape: float
    collections: int
    cpu_ms_per_collection: float
    rss_mb: float
    idle_connections: int
    idle_scrape_s: float
    threads_idle: int
    open_files_idle: int


@dataclass
class FakeGpuRun:
    startup_s: float
    scrapes: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    exposition_bytes: int
    series: int
    rss_mb: float
    cpu_percent_1hz: float
    rss_after_cpu_mb: float
    collector_p50_ms: dict[str, float]


@dataclass
class CliRun:
    startup_s: float
    startup_runs_s: list[float]
    scrapes: int
    p50_ms: float
    p99_ms: float
    series: int
    rss_mb: float


def latencies(proc: Served, warmup: int, n: int, budget_s: float,
              durations: dict[str, list[float]] | None = None) -> tuple[list[float], bytes]:
    """Up to n timed scrapes (ms) within budget_s, after `warmup`; fills durations
    (collector -> ms) from the exporter's own collector_duration gauge."""
    body = b""
    for _ in range(warmup):
        body = proc.scrape()[1]
    times: list[float] = []
    deadline = time.monotonic() + budget_s
    while len(times) < n and (len(times) < 10 or time.monotonic() < deadline):
        elapsed, body = proc.scrape()
        times.append(elapsed * 1000)
        if durations is not None:
            for name, value in _DURATION.findall(body):
                durations.setdefault(name.decode(), []).append(float(value) * 1000)
    return times, body


def cpu_at_one_hz(proc: Served, seconds: int) -> float:
    """CPU time of the process over `seconds` of one scrape a second, % of one core."""
    cpu0, t0 = proc.cpu_s(), time.monotonic()
    for i in range(seconds):
        time.sleep(max(0.0, t0 + i - time.monotonic()))
        proc.scrape()
    time.sleep(max(0.0, t0 + seconds - time.monotonic()))
    return 100 * (proc.cpu_s() - cpu0) / (time.monotonic() - t0)


def collections(proc: Served) -> int:
    found = _COLLECTIONS.search(proc.scrape()[1])
    if found is None:
        raise RuntimeError("no collections counter in the exposition")
    return int(float(found.group(1)))


def load(proc: Served, plan: Plan) -> LoadRun:
    """Many concurrent clients, then many idle connections, against one exporter."""
    per_client = plan.load_scrapes // plan.clients
    errors, times = 0, []
    lock = threading.Lock()

    def client(_: int) -> None:
        nonlocal errors
        for _ in range(per_client):
            try:
                elapsed, _body = proc.scrape()
                with lock:
                    times.append(elapsed)
            except Exception:
                with lock:
                    errors += 1

    before, cpu0 = collections(proc), proc.cpu_s()
    with ThreadPoolExecutor(plan.clients) as pool:
        list(pool.map(client, range(plan.clients)))
    cpu = proc.cpu_s() - cpu0
    ran = collections(proc) - before - 1  # less the counter's own scrape
    scrapes = len(times) + errors
    rss = proc.rss_mb()
    held = []
    try:
        for _ in range(plan.idle_connections):
            held.append(socket.create_connection(("127.0.0.1", proc.port), timeout=10))
        idle_s, _body = proc.scrape()
        threads, files = proc.ps.num_threads(), proc.ps.num_fds()
    finally:
        for s in held:
            s.close()
    return LoadRun(plan.clients, scrapes, errors, percentile(times, 50), percentile(times, 99),
                   1000 * cpu / max(1, scrapes), ran, 1000 * cpu / max(1, ran), rss,
                   len(held), idle_s, threads, files)


def fake_gpu_exporter(directory: str, plan: Plan) -> tuple[FakeGpuRun, LoadRun]:
    port = free_port()
    proc = Served([sys.executable, str(REPO / "bench" / "_exporter_with_fake_nvml.py"),
                   f"--web.listen-address=127.0.0.1:{port}", f"--metrics-dir={directory}",
                   f"--stale-after={STALE_AFTER}", f"--gpus={GPUS}"], port)
    try:
        durations: dict[str, list[float]] = {}
        times, body = latencies(proc, plan.warmup, plan.scrapes, plan.budget_s, durations)
        gpus = body.count(f"\n{cat.GPU_INFO.name}{{".encode())
        if gpus != GPUS or f'rank="{RANKS - 1}"'.encode() not in body:
            raise RuntimeError("the exposition lacks some fake GPUs or ranks")
        rss = proc.rss_mb()
        cpu = cpu_at_one_hz(proc, plan.cpu_seconds)
        fake = FakeGpuRun(proc.start_s, len(times), percentile(times, 50),
                          percentile(times, 99), max(times), len(body), series(body), rss,
                          cpu, proc.rss_mb(),
                          {k: statistics.median(v) for k, v in durations.items()})
        return fake, load(proc, plan)
    finally:
        proc.stop()


def real_cli(directory: str, plan: Plan) -> CliRun:
    starts: list[float] = []
    times: list[float] = []
    body, rss = b"", 0.0
    for i in range(plan.cli_starts):
        port = free_port()
        proc = Served([sys.executable, "-m", "dataloader_exporter", "serve", "--no-collector.gpu",
                       f"--web.listen-address=127.0.0.1:{port}", f"--metrics-dir={directory}",
                       f"--stale-after={STALE_AFTER}"], port)
        try:
            starts.append(proc.start_s)
            if i == 0:
                times, body = latencies(proc, 5, plan.cli_scrapes, plan.cli_budget_s)
                rss = proc.rss_mb()
        finally:
            proc.stop()
    return CliRun(statistics.median(starts), starts, len(times), percentile(times, 50),
                  percentile(times, 99), series(body), rss)


def report(fake: FakeGpuRun, cli: CliRun, ld: LoadRun, quick: bool, loaders: int) -> bool:
    fg, rc = "(fake 8 GPUs)", "(real CLI, no gpu)"
    lc = f"({ld.clients} clients)"
    rows: list[tuple[str, str, str, bool | None]] = [
        (f"scrape p50 {fg}", f"{fake.p50_ms:.2f} ms ({fake.scrapes} scrapes)", "", None),
        (f"scrape p99 {fg}", f"{fake.p99_ms:.2f} ms", f"<= {P99_MS:g} ms",
         fake.p99_ms <= P99_MS),
        (f"scrape max {fg}", f"{fake.max_ms:.2f} ms", "", None),
        ("exposition", f"{fake.exposition_bytes} B, {fake.series} series", "", None),
        (f"RSS after scrapes {fg}", f"{fake.rss_mb:.1f} MB", f"<= {RSS_MB:g} MB",
         fake.rss_mb <= RSS_MB),
        (f"start-up {fg}", f"{fake.startup_s:.3f} s", f"< {START_S:g} s",
         fake.startup_s < START_S),
        (f"CPU at 1 scrape/s {fg}", f"{fake.cpu_percent_1hz:.2f} % of a core", "", None),
        (f"CPU per scrape at 1/s, files changed {fg}", f"{fake.cpu_percent_1hz * 10:.1f} ms",
         f"<= {LOAD_CPU_MS:g} ms", fake.cpu_percent_1hz * 10 <= LOAD_CPU_MS),
        (f"scrape p50 {rc}", f"{cli.p50_ms:.2f} ms ({cli.scrapes} scrapes)", "", None),
        (f"scrape p99 {rc}", f"{cli.p99_ms:.2f} ms", f"<= {P99_MS:g} ms", cli.p99_ms <= P99_MS),
        (f"RSS after scrapes {rc}", f"{cli.rss_mb:.1f} MB", f"<= {RSS_MB:g} MB",
         cli.rss_mb <= RSS_MB),
        (f"start-up {rc}, median", f"{cli.startup_s:.3f} s", f"< {START_S:g} s",
         cli.startup_s < START_S),
        (f"errors {lc}", f"{ld.errors} of {ld.scrapes} scrapes", "0", ld.errors == 0),
        (f"scrape p50 {lc}", f"{ld.p50_s * 1000:.1f} ms", "", None),
        (f"scrape p99 {lc}", f"{ld.p99_s * 1000:.1f} ms", f"<= {LOAD_P99_S * 1000:g} ms",
         ld.p99_s <= LOAD_P99_S),
        (f"CPU per scrape {lc}", f"{ld.cpu_ms_per_scrape:.2f} ms", f"<= {LOAD_CPU_MS:g} ms",
         ld.cpu_ms_per_scrape <= LOAD_CPU_MS),
        (f"collections {lc}", f"{ld.collections}, {ld.cpu_ms_per_collection:.1f} ms CPU each",
         "", None),
        (f"RSS after load {lc}", f"{ld.rss_mb:.1f} MB", f"<= {RSS_MB:g} MB",
         ld.rss_mb <= RSS_MB),
        (f"scrape with {ld.idle_connections} idle connections",
         f"{ld.idle_scrape_s * 1000:.1f} ms", f"<= {IDLE_SCRAPE_S * 1000:g} ms",
         ld.idle_scrape_s <= IDLE_SCRAPE_S),
        ("threads, descriptors meanwhile", f"{ld.threads_idle}, {ld.open_files_idle}", "",
         None),
    ]
    print(f"{'figure':38} {'value':30} {'target':10} verdict")
    for name, value, target, ok in rows:
        verdict = "" if ok is None else ("PASS" if ok else "FAIL")
        print(f"{name:38} {value:30} {target:10} {verdict}")
    print("collector time, p50 of the exporter's own gauge: "
          + ", ".join(f"{k} {v:.2f} ms" for k, v in fake.collector_p50_ms.items()))
    print("real CLI start-ups: " + ", ".join(f"{s:.3f} s" for s in cli.startup_runs_s))
    passed = all(ok for *_, ok in rows if ok is not None)
    print(json.dumps(rounded({"bench": "scrape", "quick": quick, "ranks": RANKS,
                              "loaders": loaders, "gpus": GPUS, "pass": passed,
                              "fake_gpu": asdict(fake), "real_cli": asdict(cli),
                              "load": asdict(ld)}),
                     sort_keys=True), flush=True)
    return passed


def clone_ranks(written: list[Path], ranks: int) -> list[Path]:
    """Ranks len(written)..ranks-1 as copies of the written files, relabelled."""
    files = list(written)
    for rank in range(len(written), ranks):
        source = written[rank % len(written)]
        text = re.sub(r'rank="\d+"', f'rank="{rank}"', source.read_text())
        path = source.with_name(f"rank{rank}.prom")
        path.write_text(text)
        files.append(path)
    return files


def _rewrite_every_second(files: list[Path], stop: threading.Event) -> None:
    """Like live trainers: each file gets a new mtime (and so a re-read) every second."""
    while not stop.wait(1.0):
        for path in files:
            os.utime(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer scrapes and starts")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    parser.add_argument("--loaders", type=int, default=len(LOADERS), choices=(1, 2, 3, 4),
                        help=f"loaders per rank (default {len(LOADERS)})")
    args = parser.parse_args()
    plan = PLANS[args.quick]
    with tempfile.TemporaryDirectory(prefix="scrape-bench-") as directory:
        loaders = LOADERS[:args.loaders]
        files = clone_ranks(write_rank_files(Path(directory), WRITTEN, loaders), RANKS)
        size = sum(p.stat().st_size for p in files)
        print(f"{len(files)} snapshot files ({RANKS} ranks x {len(loaders)} loaders), "
              f"{size} B in all; {GPUS} fake GPUs", flush=True)
        stop = threading.Event()
        toucher = threading.Thread(target=_rewrite_every_second, args=(files, stop))
        toucher.start()
        try:
            fake, ld = fake_gpu_exporter(directory, plan)
            cli = real_cli(directory, plan)
        finally:
            stop.set()
            toucher.join()
    ok = report(fake, cli, ld, args.quick, args.loaders)
    return 1 if args.strict and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
