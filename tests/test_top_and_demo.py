"""top renders real scrapes and quits on q and Ctrl-C; the demo runs end to end."""

from __future__ import annotations

import multiprocessing
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

from dataloader_exporter import demo, instrument
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
@pytest.mark.parametrize("how", ["q", "ctrl-c", "ctrl-c-ignored"])
def test_top_draws_in_a_terminal_and_quits_cleanly(
        live: tuple[instrument.DataLoader, str], how: str) -> None:
    """ctrl-c-ignored: started with SIGINT ignored (as a background job of a script without
    job control is), Ctrl-C still quits."""
    loader, url = live
    for _ in loader:
        pass
    argv = [sys.executable, "-m", "dataloader_exporter", "top", "--url", url, "--interval",
            "0.3"]
    if how == "ctrl-c-ignored":  # ignored across exec, as a shell's `cmd &` does
        argv = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, "
                "signal.SIG_IGN); os.execv(sys.argv[1], sys.argv[1:])", *argv]
    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, stdin=follower, stdout=follower,
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
def test_the_demo_runs_three_configurations_and_the_auto_one_settles() -> None:
    """Starved, the doctor's settings, and tune=True from num_workers=0. What is asserted
    holds on a busy machine too (the demo's speed-ups are bench/tuner.py's business): the
    starved loop waits, the doctor says what to set and its settings are the second
    column, the tuner's first move is the model's count and the column shows the setting
    it settled on, within the rank's cores (the demo's samples cost CPU), and each
    speed-up is shown beside the machine's limit measured in the same run, whatever its
    value."""
    result = subprocess.run([sys.executable, "-m", "dataloader_exporter", "demo",
                             "--duration", "10", "--port", "0", "--samples", "256"],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr
    out, err = result.stdout, result.stderr
    for row in ("input stall share", "samples/s", "speed-up", "measured over",
                "others' CPU use", "epoch time", "time to first batch", "doctor's verdict"):
        assert row in out
    assert re.search(r"^\s+starved\s+tuned\s+auto\s*$", out, re.MULTILINE), out
    assert "input-bound" in _row(out, "doctor's verdict")[0], out
    # Each speed-up beside the machine's limit, measured in the same run, and said what it is.
    [line] = re.findall(r"^of ([\d.]+)x: this machine's limit, what two processes gave "
                        r"against one, .*\(([\d.]+)x before the runs, ([\d.]+)x after\)$",
                        out, re.MULTILINE)
    limit, before, after = map(float, line)
    assert limit > 0 and abs(limit - (before + after) / 2) <= 0.011, out
    first, *others = _row(out, "speed-up")
    assert first == "1.00x", out
    assert [re.sub(r"^[\d.]+x of ", "", c) for c in others] == [f"{line[0]}x"] * 2, out
    # What other processes used meanwhile, whatever it was.
    assert all(re.fullmatch(r"\d+\.\d of \d+ cores", c) for c in _row(out, "others' CPU use")), out
    starved, doctored, auto = _row(out, "settings")
    advised = re.search(r"^\s+num_workers=(\d+): ", out, re.MULTILINE)
    assert advised is not None, out
    assert starved == "num_workers=0" and f"num_workers={advised[1]}" in doctored, out
    assert re.search(r"dataloader 'auto': num_workers 0 -> \d+: a batch takes", err), err
    # The setting it settled on last (a settled loader is watched, and may tune again).
    settled = re.findall(r"dataloader 'auto': the tuner is stable at num_workers=(\d+)", err)
    assert settled, err
    assert auto.startswith(f"num_workers={settled[-1]}"), out
    assert int(settled[-1]) <= advisor.local_cpu().usable + 1, out
    # Settled (the stable line above); a loader watched after it may be trying again at
    # the end, at the settings it settled on (checked above).
    assert re.search(r"epochs, (settled|still tuning)$", _row(out, "measured over")[2]), out
    assert all(float(r) > 0 for r in _row(out, "samples/s")), out


def test_the_machine_limit_is_a_ratio_and_leaves_no_child() -> None:
    earlier = set(multiprocessing.active_children())  # other tests' loaders' workers
    limit = demo.machine_limit(seconds=0.02, rounds=1)
    assert limit is not None and limit > 0
    assert set(multiprocessing.active_children()) <= earlier


def test_an_interrupted_limit_measurement_leaves_no_child() -> None:
    """The interrupt lands while the children start or render (a turn lasts 5 s), as
    Ctrl-C would."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    earlier = set(multiprocessing.active_children())
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            demo.machine_limit(seconds=5, rounds=1)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert set(multiprocessing.active_children()) <= earlier


def test_top_without_a_terminal_exits_2_with_one_line_pointing_at_the_doctor() -> None:
    result = subprocess.run([sys.executable, "-m", "dataloader_exporter", "top", "--url",
                             "http://127.0.0.1:9/metrics"], stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "doctor" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
