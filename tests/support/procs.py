"""Real processes for the tests: Debian's Prometheus, and the exporter CLI.

Prometheus starts once per test session on 127.0.0.1 with a temporary storage dir and
a file_sd target list, so each test adds its own targets (labelled test=<name>) instead
of restarting the server. New targets show up after ~5-6 s: poll with deadlines.
"""

from __future__ import annotations

import json
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "frameworks"  # training scripts run under real frameworks
HF_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
              "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}


def built_at(script: str, start: str, caller: str | None = None) -> str:
    """The name zero-code mode gives a loader built on the first line of a script in
    SCRIPTS that starts (indentation aside) with `start`: FILE:LINE, then -FILE:LINE of
    the line starting with `caller` when it is built inside a function
    (instrument/naming.py)."""
    lines = (SCRIPTS / script).read_text().splitlines()

    def at(text: str) -> str:
        line = next(n for n, t in enumerate(lines, 1) if t.lstrip().startswith(text))
        return f"{script}:{line}"

    return at(start) if caller is None else f"{at(start)}-{at(caller)}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 10.0, context: ssl.SSLContext | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, str]:
    """(status, body) of a GET; an HTTP error status is returned, not raised."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                    timeout=timeout, context=context) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def finish(proc: subprocess.Popen[Any], stop: Path, timeout: float) -> int:
    """Asks a test's subprocess to stop (it polls for the file `stop`); kills it past
    `timeout`. Returns its exit status."""
    stop.touch()
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


class Prometheus:
    """A Prometheus server scraping every second the targets tests add."""

    def __init__(self, binary: str, workdir: Path, rule_files: list[str] | None = None,
                 scrape_configs: list[dict[str, Any]] | None = None) -> None:
        self.workdir = workdir
        self.sd_dir = workdir / "targets"
        self.sd_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                       "scrape_timeout": "1s"},
            "rule_files": rule_files or [],
            "scrape_configs": [{
                "job_name": "dataloader-exporter",
                "file_sd_configs": [{"files": [str(self.sd_dir / "*.json")],
                                     "refresh_interval": "1s"}],
            }, *(scrape_configs or [])],
        }
        cfg = workdir / "prometheus.yml"
        cfg.write_text(json.dumps(config))  # JSON is YAML
        self.log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [binary, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(workdir / 'prometheus.log').read_text()}")
            try:
                if http_get(self.url + "/-/ready", timeout=1)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("prometheus did not become ready in 30 s")

    def add_target(self, name: str, address: str, labels: dict[str, str] | None = None) -> None:
        """Scrape `address` with the extra label test=<name> (atomic file write)."""
        entry = [{"targets": [address], "labels": {"test": name, **(labels or {})}}]
        tmp = self.sd_dir / f".{name}.tmp"
        tmp.write_text(json.dumps(entry))
        os.replace(tmp, self.sd_dir / f"{name}.json")

    def remove_target(self, name: str) -> None:
        (self.sd_dir / f"{name}.json").unlink(missing_ok=True)

    def api(self, path: str, **params: str) -> Any:
        status, body = http_get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}")
        data = json.loads(body)
        if data.get("status") != "success":
            raise AssertionError(f"{path} {params}: {status} {data}")
        return data["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr)["result"])

    def wait_for(self, expr: str, predicate: Any = bool, timeout: float = 25.0
                 ) -> list[dict[str, Any]]:
        """Polls an instant query until predicate(result) holds; returns the result."""
        deadline = time.monotonic() + timeout
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(expr)
            if predicate(result):
                return result
            time.sleep(0.25)
        raise AssertionError(f"timed out waiting for {expr!r}; last result {result}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def scalar(result: list[dict[str, Any]]) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


class Exporter:
    """`python -m dataloader_exporter serve` as a real process; knows the URL it listens on."""

    LISTENING = re.compile(r"listening on (https?://\S+)")

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 python: str = sys.executable, cwd: Path = REPO,
                 max_files: int | None = None) -> None:
        self.lines: list[str] = []
        argv = [python, "-m", "dataloader_exporter", "serve",
                "--web.listen-address=127.0.0.1:0", *args]
        if max_files is not None:  # a descriptor limit, as a small container may have
            argv = ["prlimit", f"--nofile={max_files}", "--", *argv]
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd,
            env={**os.environ, **(env or {})})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + 20
        self.url = ""
        while time.monotonic() < deadline and not self.url:
            for line in list(self.lines):
                m = self.LISTENING.search(line)
                if m:
                    self.url = m.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        if not self.url:
            self.stop()
            raise RuntimeError("exporter did not start:\n" + "".join(self.lines))

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def address(self) -> str:
        return self.url.split("://", 1)[1]

    def metrics(self) -> str:
        status, body = http_get(self.url + "/metrics")
        assert status == 200, status
        return body

    def stop(self, timeout: float = 10) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.close()
        return code

    def close(self) -> None:
        """Releases the pipe once the process has exited."""
        self._reader.join(timeout=5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


class Run:
    """One finished framework run: its truth files and its snapshot files, by rank."""

    def __init__(self, out: Path, result: subprocess.CompletedProcess[str]) -> None:
        self.log = result.stdout + result.stderr
        assert result.returncode == 0, self.log[-4000:]
        self.truth = {t["rank"]: t for t in (json.loads(p.read_text())
                                             for p in out.glob("truth-*.json"))}
        self.files = sorted((out / "m").glob("*.prom"))
        self.samples: dict[int, list[tuple[str, dict[str, str], float]]] = {}
        for path in self.files:
            pid = int(re.match(r".*-(\d+)-[0-9a-f]+\.prom$", path.name).group(1))  # type: ignore[union-attr]
            rank = next(r for r, t in self.truth.items() if t["pid"] == pid)
            self.samples[rank] = [(s.name, s.labels, s.value) for f in
                                  text_string_to_metric_families(path.read_text())
                                  for s in f.samples]

    def value(self, rank: int, name: str, **labels: str) -> float | None:
        found = [v for n, lab, v in self.samples[rank] if n == name and
                 all(lab.get(k) == x for k, x in labels.items())]
        assert len(found) <= 1, (name, labels, found)
        return found[0] if found else None

    def labels(self, rank: int, name: str) -> list[dict[str, str]]:
        return [lab for n, lab, _ in self.samples[rank] if n == name]


def run_script(out: Path, argv: list[str], env: dict[str, str] | None = None,
               timeout: float = 240) -> Run:
    """Runs a test script to its end (killed past `timeout`) in `out`, snapshots in out/m."""
    (out / "m").mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **HF_OFFLINE, "PYTHONPATH": str(SCRIPTS), **(env or {})}
    result = subprocess.run(argv, cwd=out, env=full_env, capture_output=True, text=True,
                            timeout=timeout)
    return Run(out, result)
