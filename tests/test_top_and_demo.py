"""top renders real scrapes and quits on q and Ctrl-C; the demo runs end to end."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from support.procs import REPO
from support.torch_helpers import SleepDataset

from dataloader_exporter import instrument
from dataloader_exporter.core import advisor
from dataloader_exporter.diagnosis import top
from dataloader_exporter.diagnosis.signals import Scrape, Window, loaders

pytestmark = pytest.mark.torch


@pytest.fixture
def live() -> Iterator[tuple[instrument.DataLoader, str]]:
    reg = CollectorRegistry()
    handle = instrument.serve(0, addr="127.0.0.1", registry=reg)
    loader = instrument.DataLoader(SleepDataset(64, 0.002), batch_size=4, num_workers=2,
                                   persistent_workers=True, name="train", registry=reg)
    yield loader, handle.url + "/metrics"
    handle.shutdown()


def test_render_shows_a_row_per_loader_from_two_real_scrapes(
        live: tuple[instrument.DataLoader, str]) -> None:
    loader, url = live
    first = Scrape.fetch(url)
    for _ in loader:
        pass
    frame = top.render(loaders(Window.between(first, Scrape.fetch(url))), url)
    assert frame[2] == top.HEADER
    [line] = [row for row in frame if row.startswith("train")]
    cols = line.split()
    assert cols[1] == "0" and cols[2].endswith("%") and cols[-3] == "2/2"
    assert float(cols[5]) > 0  # batches/s
    assert top.render([], url)[3] == "(no DataLoader metrics yet)"


def _read_until(fd: int, pattern: str, timeout: float) -> str:
    out = b""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                out += os.read(fd, 65536)
            except OSError:
                break
            if re.search(pattern, out.decode(errors="replace")):
                break
    return out.decode(errors="replace")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["q", "ctrl-c"])
def test_top_draws_in_a_terminal_and_quits_cleanly(
        live: tuple[instrument.DataLoader, str], how: str) -> None:
    loader, url = live
    for _ in loader:
        pass
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "dataloader_exporter", "top", "--url", url,
                             "--interval", "0.3"], stdin=follower, stdout=follower,
                            stderr=follower, cwd=REPO, start_new_session=True,
                            env={**os.environ, "TERM": "xterm", "LINES": "24", "COLUMNS": "100"})
    os.close(follower)
    try:
        # curses moves the cursor rather than printing spaces: look for the row's parts.
        screen = _read_until(leader, r"train(?s:.)*2/2", 15)
        assert "LOADER" in screen and re.search(r"train(?s:.)*2/2", screen), screen
        if how == "q":
            os.write(leader, b"q")
        else:
            os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=5) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)


def _row(out: str, label: str) -> list[str]:
    """A row of the demo's table, one cell a column (cells are 2+ spaces apart)."""
    [line] = [line for line in out.splitlines() if line.startswith(label + "  ")]
    return re.split(r"\s{2,}", line.strip())[1:]


@pytest.mark.slow
def test_the_demo_runs_three_configurations_and_the_auto_one_settles_on_a_worker() -> None:
    """Starved, the doctor's settings, and tune=True from num_workers=0: the tuner gives
    the loop the workers its model asks for within the rank's cores and keeps them;
    timing asserts allow for a loaded machine (the runs are seconds apart)."""
    result = subprocess.run([sys.executable, "-m", "dataloader_exporter", "demo",
                             "--duration", "10", "--port", "0", "--samples", "256"],
                            capture_output=True, text=True, timeout=180, cwd=REPO)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for row in ("input stall share", "samples/s", "measured over", "epoch time",
                "time to first batch", "doctor's verdict"):
        assert row in out
    assert re.search(r"^\s+starved\s+tuned\s+auto\s*$", out, re.MULTILINE), out
    assert "num_workers=0" in out and "input-bound" in out
    speedup = float(re.search(r"speed-up: ([\d.]+)x", out).group(1))  # type: ignore[union-attr]
    assert speedup > 1.0, out
    starved, _, auto = _row(out, "settings")
    cores = advisor.local_cpu().usable  # the demo's samples cost CPU: no more workers
    workers = int(re.match(r"num_workers=(\d+)", auto).group(1))  # type: ignore[union-attr]
    assert starved == "num_workers=0" and 1 <= workers <= cores + 1, out
    assert re.search(r"dataloader 'auto': num_workers 0 -> \d+: a batch takes", result.stderr), \
        result.stderr
    assert "dataloader 'auto': the tuner is stable at" in result.stderr, result.stderr
    assert _row(out, "measured over")[2].endswith("epochs, settled"), out
    rates = [float(r) for r in _row(out, "samples/s")]
    assert rates[2] > 0.9 * rates[0], out  # at least the starved rate, within noise


def test_top_without_a_terminal_exits_2_with_one_line_pointing_at_the_doctor() -> None:
    result = subprocess.run([sys.executable, "-m", "dataloader_exporter", "top", "--url",
                             "http://127.0.0.1:9/metrics"], stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "doctor" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
