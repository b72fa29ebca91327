"""An exporter process for the scrape benchmark: start-up time, scrapes, RSS and CPU time."""

from __future__ import annotations

import http.client
import math
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from time import perf_counter
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]


# What Prometheus 2.x sends: it prefers OpenMetrics, so that is the format to time.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                     "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(port: int, path: str = "/metrics", timeout: float = 10.0) -> tuple[int, bytes]:
    """One GET on a fresh connection (no keep-alive): (status, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Connection": "close", "Accept": PROMETHEUS_ACCEPT})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), nearest rank."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def rounded(value: Any) -> Any:
    """Floats to 4 decimals, through dicts and lists, for the JSON line."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return [rounded(v) for v in value] if isinstance(value, list) else value


def series(body: bytes) -> int:
    return sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))


class Served:
    """Starts `argv` (which must listen on `port`); start_s is Popen to the first 200."""

    def __init__(self, argv: Sequence[str], port: int, timeout: float = 20.0) -> None:
        self.port = port
        self.lines: list[str] = []
        start = perf_counter()
        self.proc = subprocess.Popen(list(argv), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, cwd=REPO)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.start_s = float("nan")
        try:
            self._wait_ready(start, timeout)
            self.ps = psutil.Process(self.proc.pid)
        except BaseException:
            self.stop()
            raise

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def _wait_ready(self, start: float, timeout: float) -> None:
        deadline = start + timeout
        while perf_counter() < deadline:
            try:
                if get(self.port, timeout=2.0)[0] == 200:
                    self.start_s = perf_counter() - start
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.002)
        raise RuntimeError(f"exporter did not serve /metrics (exit {self.proc.poll()}):\n"
                           + "".join(self.lines))

    def scrape(self) -> tuple[float, bytes]:
        """One timed scrape of /metrics: (seconds, body)."""
        t0 = perf_counter()
        status, body = get(self.port)
        elapsed = perf_counter() - t0
        if status != 200:
            raise RuntimeError(f"/metrics answered {status}")
        return elapsed, body

    def rss_mb(self) -> float:
        return float(self.ps.memory_info().rss) / 1e6

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return float(t.user + t.system)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
