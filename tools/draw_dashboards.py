"""Draws the generated dashboards from a real run, without Grafana: docs/pictures/.

Starts Debian's `prometheus` (scraping every second, with the committed recording rules),
`dataloader-exporter demo` (a starved, a doctor-tuned and a self-tuning CPU run, served
in-process) and the exporter over a fake NVML (bench/_exporter_with_fake_nvml.py) for the
GPU panels. When the demo ends, every query of every panel the project's dashboards hold
runs, its variables expanded as Grafana does with every value selected (All), over the
run's window; each dashboard becomes one PNG named by its uid, and manifest.json records
what each panel showed. Panels that had no data in the run are left out of the PNG and
named in the manifest. Every process started here is stopped on the way out.

    .venv/bin/python tools/draw_dashboards.py [--duration 120] [--out docs/pictures]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import io
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from draw_panels import draw_board
from matplotlib.figure import Figure
from PIL import Image

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.dashboards.build import BOARDS
from dataloader_exporter.dashboards.model import BARGAUGE, Panel

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "deploy" / "prometheus" / "recording.yml"
FAKE_NVML = REPO / "bench" / "_exporter_with_fake_nvml.py"
JOB = "dataloader-exporter"
# Stable instance labels, so that legends read the same from run to run.
TRAINER = "node-1:9478"
SIDECAR = "node-1:9479"
GPUS = 2
# Ten scrapes: smooth over the demo's sub-second epochs, short enough that each of its
# three runs reaches its level (Grafana's own choice, 4 scrapes, is jumpy at 1 s scrapes).
RATE_INTERVAL = "10s"
STEP = 2  # seconds between the points of a range query
SAMPLES = 256  # the demo's smallest epoch: many epochs, so the tuner settles quickly
NO_DATA = "no data in this run"


@dataclass
class Series:
    legend: str
    times: list[float]  # one per STEP over the window; values missing there are NaN
    values: list[float]

    @property
    def points(self) -> int:
        return sum(1 for v in self.values if math.isfinite(v))


@dataclass
class Shown:
    """A panel and the series its queries returned in the run (those with data)."""

    panel: Panel
    series: list[Series]

    @property
    def points(self) -> int:
        """Points drawn: a bar gauge draws each series' last value, the others every one."""
        if self.panel.kind == BARGAUGE:
            return len(self.series)
        return sum(s.points for s in self.series)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_until_served(url: str, proc: subprocess.Popen[bytes], log: Path,
                      timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited early:\n{log.read_text()[-3000:]}")
        try:
            if http_get(url, timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not served within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


class Processes:
    """The processes started here, each in a session of its own so that its children (the
    demo's DataLoader workers) stop with it."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.logs / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                    start_new_session=True)
        self.started.append(proc)
        return proc, log

    def stop_all(self) -> None:
        """SIGTERM to each group (a leader that has exited may leave workers), then SIGKILL
        to those still running after 15 s."""
        for proc in reversed(self.started):
            _signal_group(proc, signal.SIGTERM)
        for proc in reversed(self.started):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()


def _signal_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    with suppress(ProcessLookupError):  # the whole group has exited
        os.killpg(proc.pid, signum)


def prometheus_config(trainer: str, sidecar: str) -> dict[str, Any]:
    """Scrapes the demo and the fake-NVML exporter as one job every second; of the second,
    only the GPU series are kept (the demo's host already gives /dev/shm and memory)."""
    gpu = "|".join(m.name for m in cat.ALL if m.source == cat.GPU)
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                   "scrape_timeout": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{
            "job_name": JOB,
            "static_configs": [{"targets": [trainer], "labels": {"instance": TRAINER}},
                               {"targets": [sidecar], "labels": {"instance": SIDECAR}}],
            "metric_relabel_configs": [{
                "source_labels": ["instance", "__name__"], "action": "keep",
                "regex": f"{re.escape(TRAINER)};.*|{re.escape(SIDECAR)};({gpu})"}],
        }],
    }


@contextmanager
def real_run(duration: float, work: Path) -> Iterator[tuple[str, float, float]]:
    """Runs the demo to its end under Prometheus; yields (Prometheus URL, start, end)."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("prometheus not found: `make prometheus` installs Debian's package")
    procs = Processes(work)
    try:
        trainer, sidecar, prom = free_port(), free_port(), free_port()
        config = work / "prometheus.yml"
        config.write_text(json.dumps(prometheus_config(f"127.0.0.1:{trainer}",
                                                       f"127.0.0.1:{sidecar}")))
        proc, log = procs.start("prometheus", [
            binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom}", "--log.level=warn"])
        url = f"http://127.0.0.1:{prom}"
        wait_until_served(url + "/-/ready", proc, log)
        empty = work / "snapshots"  # the demo serves in-process: no snapshot files
        empty.mkdir()
        proc, log = procs.start("sidecar", [
            sys.executable, str(FAKE_NVML), "--metrics-dir", str(empty), "--gpus", str(GPUS),
            "--web.listen-address", f"127.0.0.1:{sidecar}"])
        wait_until_served(f"http://127.0.0.1:{sidecar}/metrics", proc, log)
        start = time.time()
        demo, log = procs.start("demo", [
            sys.executable, "-m", "dataloader_exporter", "demo", "--port", str(trainer),
            "--duration", str(duration), "--samples", str(SAMPLES)])
        try:
            code = demo.wait(timeout=2 * duration + 120)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the demo ran past {2 * duration + 120:.0f} s") from None
        if code != 0:
            raise RuntimeError(f"the demo exited with {code}:\n{log.read_text()[-3000:]}")
        time.sleep(3)  # the rules' last evaluation
        yield url, start, time.time()
    finally:
        procs.stop_all()


def expand(expr: str) -> str:
    """The query Grafana sends with every variable at All (".*"); names that are no
    variable, such as label_replace's $1, stay as they are."""
    values = {"job": ".*", "instance": ".*", "loader": ".*", "rank": ".*", "gpu": ".*",
              "namespace": ".*", "__rate_interval": RATE_INTERVAL}
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m.group(1), m.group(0)), expr)


def legend_of(fmt: str, labels: dict[str, str]) -> str:
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)
    return " ".join(text.split())


def query_range(url: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    params = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}",
                                     "end": f"{end:.3f}", "step": str(STEP)})
    status, body = http_get(f"{url}/api/v1/query_range?{params}", timeout=30)
    data = json.loads(body)
    if data.get("status") != "success":
        raise RuntimeError(f"{expr}: {status} {data}")
    return list(data["data"]["result"])


def panel_series(url: str, panel: Panel, start: float, end: float) -> list[Series]:
    """Every target's series with at least one finite point, sorted by legend per target."""
    times = [start + i * STEP for i in range(int((end - start) // STEP) + 1)]
    out = []
    for fmt, expr in panel.targets:
        found = []
        for result in query_range(url, expand(expr), times[0], times[-1]):
            at = {round((float(t) - times[0]) / STEP): float(v) for t, v in result["values"]}
            values = [at.get(i, math.nan) for i in range(len(times))]
            labels = sorted(result["metric"].items())
            found.append((legend_of(fmt, result["metric"]), labels, values))
        out += [Series(legend, times, values) for legend, _, values in sorted(found)
                if any(math.isfinite(v) for v in values)]
    return out


def save_png(fig: Figure, path: Path) -> None:
    """Writes the figure as a 256-colour PNG (a third of the RGBA one's size, the colours
    kept), with no metadata that would change from one run to the next."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    image = Image.open(buffer).convert("RGB")
    image.quantize(256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE).save(
        path, format="PNG", optimize=True)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def draw(url: str, start: float, end: float, out: Path, note: str) -> dict[str, Any]:
    """Draws every board into out/<uid>.png; returns the manifest's entry per uid."""
    boards: dict[str, Any] = {}
    for board in BOARDS:
        shown = {id(p): Shown(p, panel_series(url, p, start, end)) for p in board.panels()}
        png = out / f"{board.uid}.png"
        fig = draw_board(board, [[shown[id(p)] for p in row.panels if shown[id(p)].series]
                                 for row in board.rows], note)
        save_png(fig, png)
        boards[board.uid] = {"file": png.name, "sha256": sha256(png), "title": board.title,
                             "panels": [entry(shown[id(p)]) for p in board.panels()]}
    return boards


def entry(shown: Shown) -> dict[str, Any]:
    p = shown.panel
    out: dict[str, Any] = {"title": p.title, "exprs": [expr for _, expr in p.targets],
                           "drawn": bool(shown.series), "series": len(shown.series),
                           "points": shown.points}
    if not shown.series:
        out["why"] = NO_DATA
    return out


def write_manifest(out: Path, boards: dict[str, Any], command: str, date: str) -> Path:
    path = out / "manifest.json"
    data = {"command": command, "date": date, "dashboards": boards,
            "run": f"dataloader-exporter demo --samples {SAMPLES} under Prometheus "
                   f"(1 s scrapes, $__rate_interval={RATE_INTERVAL}); GPU panels from "
                   f"a fake NVML with {GPUS} GPUs"}
    path.write_text(json.dumps(data, sort_keys=True, indent=2) + "\n", encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=120.0,
                        help="seconds of the demo's training, a third for each run (default 120)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "pictures",
                        help="where the PNGs and manifest.json go (default docs/pictures)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    # Stopped with SIGTERM or Ctrl-C (even where started in the background, which ignores
    # SIGINT), it unwinds and stops what it started.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupted)
    began = time.monotonic()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    with (tempfile.TemporaryDirectory(prefix="draw-dashboards-") as tmp,
          real_run(args.duration, Path(tmp)) as (url, start, end)):
        print(f"run: {end - start:.0f} s; drawing", flush=True)
        note = (f"Drawn from a real run on {date}: `dataloader-exporter demo` on "
                f"{os.cpu_count()} CPU cores, one loader after another (starved: "
                "num_workers=0; tuned: the doctor's settings; auto: tune=True); "
                f"{GPUS} GPUs from a fake NVML; variables at All.")
        boards = draw(url, start, end, args.out, note)
    command = " ".join(["python tools/draw_dashboards.py", *sys.argv[1:]]).strip()
    manifest = write_manifest(args.out, boards, command, date)
    for board in boards.values():
        missing = [p["title"] for p in board["panels"] if not p["drawn"]]
        print(f"{board['file']}: {len(board['panels']) - len(missing)} panels drawn"
              + (f"; {NO_DATA}: {', '.join(missing)}" if missing else ""))
    print(f"{manifest} written in {time.monotonic() - began:.0f} s")
    return 0


def _interrupted(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


if __name__ == "__main__":
    sys.exit(main())
