"""`doctor --metrics-dir`: the trainer's snapshot files, read while the run goes on or
after it has ended (the whole run), written by the real writer in a real process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.helpers import deadline_poll, parse
from support.procs import REPO, Exporter, finish
from support.real_snapshots import real_snapshot

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.core.envnames import ENV_SETTINGS
from dataloader_exporter.diagnosis import dirsource, doctor_cli, top
from dataloader_exporter.diagnosis.machine import Machine
from dataloader_exporter.diagnosis.report import Report, build_report, env_line
from dataloader_exporter.diagnosis.signals import (
    Labels,
    LoaderSignals,
    Scrape,
    Series,
    loaders,
    window_of,
)

# A training script: iterates `epochs` epochs of a loader named "train" (or, with a stop
# file, until it appears), then writes what it handed out to truth.json and exits; the
# snapshot writer writes its last file at exit.
TRAIN = """
import json, sys, time
from pathlib import Path
from dataloader_exporter import instrument
from support.torch_helpers import SleepDataset
a = json.loads(sys.argv[1])
loader = instrument.DataLoader(SleepDataset(a["n"], a["delay"]), batch_size=a["batch_size"],
                               name="train", metrics_dir=a["dir"])
batches = samples = epochs = 0
stop = Path(a["stop"]) if a["stop"] else None
while (stop is None and epochs < a["epochs"]) or (stop is not None and not stop.exists()):
    for x, _ in loader:
        batches += 1
        samples += len(x)
    epochs += 1
Path(a["dir"], "..", "truth.json").write_text(json.dumps({"batches": batches,
                                                         "samples": samples}))
"""
TRUTH = "truth.json"


def train(out: Path, n: int = 24, delay: float = 0.01, batch_size: int | None = 4,
          epochs: int = 2, stop: Path | None = None) -> subprocess.Popen[bytes]:
    """Starts the training script writing snapshots to out/m, its log to out/train.log;
    its truth lands in out."""
    (out / "m").mkdir(parents=True, exist_ok=True)
    args = {"dir": str(out / "m"), "n": n, "delay": delay, "batch_size": batch_size,
            "epochs": epochs, "stop": str(stop) if stop else ""}
    with open(out / "train.log", "w") as log:
        return subprocess.Popen([sys.executable, "-c", TRAIN, json.dumps(args)], cwd=REPO,
                                env={**os.environ, "PYTHONPATH": "tests:."},
                                stdout=subprocess.DEVNULL, stderr=log)


def trained(out: Path, **kwargs: Any) -> dict[str, float]:
    """Runs the training script to its end; what it handed out."""
    proc = train(out, **kwargs)
    assert proc.wait(timeout=120) == 0, (out / "train.log").read_text()
    return dict(json.loads((out / TRUTH).read_text()))


def written_ago(directory: Path, seconds: float) -> None:
    """Sets the files' modification time: last written `seconds` ago."""
    when = time.time() - seconds
    for path in directory.iterdir():
        os.utime(path, (when, when))


@pytest.fixture(scope="module")
def ended(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, float]]:
    """A run that ended a minute ago, input-bound (slow samples, num_workers=0): its
    directory and what it handed out."""
    out = tmp_path_factory.mktemp("ended")
    truth = trained(out)
    written_ago(out / "m", 60)
    return out / "m", truth


def copy_of(ended: tuple[Path, dict[str, float]], tmp_path: Path) -> Path:
    """The ended run's files as a copy (modification times kept), for one test to alter."""
    return Path(shutil.copytree(ended[0], tmp_path / "copy"))


def doctor(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dataloader_exporter", "doctor", *argv],
                          capture_output=True, text=True, cwd=REPO, timeout=60)


def as_json(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode in (0, 1), result.stderr
    return dict(json.loads(result.stdout))


def train_rank0(report: dict[str, Any]) -> dict[str, Any]:
    [found] = [d for d in report["loaders"] if (d["loader"], d["rank"]) == ("train", "0")]
    return dict(found)


def loop_seconds(directory: Path) -> float:
    """The files' fetch wait plus step sums: the loop time of loader train, rank 0."""
    series = parse("".join(p.read_text() for p in directory.glob("*.prom")))
    lr = (("loader", "train"), ("rank", "0"))
    fetch = series[(cat.TIME.name + "_sum", (lr[0], ("phase", cat.PHASE_FETCH), lr[1]))]
    return fetch + series[(cat.STEP.name + "_sum", lr)]


@pytest.mark.torch  # a training script writes the directory the doctor reads
@pytest.mark.slow
def test_an_ended_input_bound_run_is_diagnosed_from_its_files(
        ended: tuple[Path, dict[str, float]]) -> None:
    directory = ended[0]
    result = doctor("--metrics-dir", str(directory))
    assert result.returncode == 1, result.stderr
    head = result.stdout.splitlines()[0]
    assert head == (f"dataloader doctor: {directory}, whole run (the files are no longer "
                    "written): rates per second of loop time")
    assert "loader train, rank 0: INPUT-BOUND" in result.stdout
    assert "num_workers=" in result.stdout and result.stderr == ""


@pytest.mark.torch  # a training script writes the directory the doctor reads
@pytest.mark.slow
def test_the_whole_run_in_json_holds_what_the_script_handed_out(
        ended: tuple[Path, dict[str, float]]) -> None:
    directory, truth = ended
    report = as_json(doctor("--metrics-dir", str(directory), "--format", "json"))
    figures = train_rank0(report)["figures"]
    assert report["whole_run"] is True and "whole run" in report["source"]
    assert figures["batches"] == truth["batches"] == 12
    assert figures["samples"] == truth["samples"] == 48
    assert figures["window_seconds"] == pytest.approx(loop_seconds(directory), rel=1e-9)
    assert figures["batches_per_second"] == pytest.approx(
        truth["batches"] / loop_seconds(directory), rel=1e-9)
    assert train_rank0(report)["verdict"] == "input-bound" and not report["healthy"]


@pytest.mark.torch  # a training script writes the directory the doctor reads
@pytest.mark.slow
def test_the_env_format_prints_the_advice_for_an_ended_run(
        ended: tuple[Path, dict[str, float]]) -> None:
    result = doctor("--metrics-dir", str(ended[0]), "--format", "env")
    assert result.returncode == 0, result.stderr
    [line] = result.stdout.splitlines()
    assert line.startswith(f"{ENV_SETTINGS}=") and "train.num_workers=" in line
    assert "train.persistent_workers=true" in line


@pytest.mark.torch  # a training script writes the directory the doctor reads
@pytest.mark.slow
def test_fresh_files_with_no_batch_between_reads_are_a_live_run_never_an_ended_one(
        ended: tuple[Path, dict[str, float]], tmp_path: Path) -> None:
    """Files written just now whose loop hands out nothing: a stalled (or paused) run
    looks exactly so, and must not be reported as a healthy ended run."""
    directory = copy_of(ended, tmp_path)
    written_ago(directory, 0)  # fresh files, but nothing moves between the reads
    report = as_json(doctor("--metrics-dir", str(directory), "--interval", "0.3",
                            "--format", "json"))
    assert report["whole_run"] is False
    assert report["source"] == f"{directory}, 0.3 s between reads"
    assert train_rank0(report)["verdict"] == "idle"
    assert train_rank0(report)["figures"]["batches"] == 0


@pytest.mark.torch  # a training script writes the directory the doctor reads
@pytest.mark.slow
def test_the_doctor_never_deletes_nor_skips_an_old_file(
        ended: tuple[Path, dict[str, float]], tmp_path: Path) -> None:
    directory = copy_of(ended, tmp_path)
    long_ago = time.time() - 90 * 24 * 3600
    [snapshot] = directory.glob("*.prom")
    leftover = directory / f"{snapshot.name}.123.456"  # a writer killed mid-write leaves it
    leftover.write_text("half a file")
    for path in (snapshot, leftover):  # far past the sidecar's stale and remove ages
        os.utime(path, (long_ago, long_ago))
    report = as_json(doctor("--metrics-dir", str(directory), "--format", "json"))
    assert snapshot.exists() and leftover.exists()
    assert train_rank0(report)["figures"]["batches"] == ended[1]["batches"]


def test_an_empty_or_missing_directory_is_unreadable_in_one_line(tmp_path: Path) -> None:
    for directory, says in ((tmp_path, "no snapshot file (*.prom) in"),
                            (tmp_path / "missing", "No such file or directory")):
        result = doctor("--metrics-dir", str(directory))
        assert result.returncode == 2 and result.stdout == ""
        [line] = result.stderr.splitlines()
        assert line.startswith("dataloader-exporter doctor: cannot read the metrics")
        assert says in line and str(directory) in line


def test_a_directory_of_only_a_corrupt_file_is_unreadable_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "vm-1-abc.prom").write_bytes(b"\x00\xffnot metrics at all\n")
    result = doctor("--metrics-dir", str(tmp_path), "--format", "json")
    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert "no valid snapshot file" in line and "1 file in" in line and "malformed" in line


@pytest.mark.torch  # a training script writes the directory the doctor reads
@pytest.mark.slow
def test_corrupt_files_beside_good_ones_are_skipped_and_counted(
        ended: tuple[Path, dict[str, float]], tmp_path: Path) -> None:
    directory = copy_of(ended, tmp_path)
    (directory / "vm-1-abc.prom").write_text("dataloader_batches_total{loader=\n")
    (directory / "vm-2-abc.prom").write_text("# TYPE x counter\nx 1\n")
    result = doctor("--metrics-dir", str(directory), "--format", "json")
    assert train_rank0(as_json(result))["figures"]["batches"] == ended[1]["batches"]
    [line] = result.stderr.splitlines()
    assert line.startswith(f"dataloader-exporter doctor: skipped 2 files in {directory} "
                           "that are not valid snapshots (")


def _as_rank(source: Path, name: str, rank: str, ago: float) -> None:
    """A copy of a snapshot file, renamed and relabelled as `rank`, written `ago` s ago."""
    target = source.parent / name
    target.write_text(source.read_text().replace('rank="0"', f'rank="{rank}"'))
    os.utime(target, (time.time() - ago, time.time() - ago))


@pytest.mark.torch  # a training script writes the directory the doctor reads
@pytest.mark.slow
def test_an_earlier_runs_files_in_the_directory_are_left_out_and_said(
        ended: tuple[Path, dict[str, float]], tmp_path: Path) -> None:
    directory = copy_of(ended, tmp_path)
    written_ago(directory, 60)
    [mine] = directory.glob("*.prom")
    _as_rank(mine, "old-1-aaaa.prom", "2", 3600)  # last run's rank 2, an hour older
    result = doctor("--metrics-dir", str(directory), "--format", "json")
    report = as_json(result)
    assert {d["rank"] for d in report["loaders"]} == {"0"}
    assert "left out 1 file written more than 30 s before the newest (an earlier run)" in (
        result.stderr)


@pytest.mark.torch  # a training script writes the directory the doctor reads
@pytest.mark.slow
def test_ranks_share_a_machine_only_when_their_files_name_the_same_host(
        ended: tuple[Path, dict[str, float]], tmp_path: Path) -> None:
    directory = copy_of(ended, tmp_path)
    written_ago(directory, 60)
    [mine] = directory.glob("*.prom")
    host = mine.name.rsplit("-", 2)[0]
    _as_rank(mine, f"{host}-1-bbbb.prom", "1", 60)  # the same host: 2 local ranks
    _as_rank(mine, "elsewhere-1-cccc.prom", "2", 60)  # another machine's rank
    report = as_json(doctor("--metrics-dir", str(directory), "--format", "json"))
    local = {d["rank"]: d["figures"]["local_ranks"] for d in report["loaders"]}
    assert local == {"0": 2, "1": 2, "2": 1}


@pytest.mark.torch  # a training script writes the directory the doctor reads
@pytest.mark.slow
def test_a_live_run_is_read_twice_as_a_window(tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    proc = train(tmp_path, n=16, delay=0.005, stop=stop)
    try:
        wrote = deadline_poll(lambda: any(
            f"{cat.BATCHES.name}{{" in p.read_text() for p in (tmp_path / "m").glob("*.prom")),
            timeout=60)
        assert wrote, "no snapshot with batches"
        # Reads 2.5 s apart: at least two of the writer's (one a second) fall between.
        result = doctor("--metrics-dir", str(tmp_path / "m"), "--interval", "2.5",
                        "--format", "json")
    finally:
        assert finish(proc, stop, timeout=30) == 0
    report = as_json(result)
    figures = train_rank0(report)["figures"]
    assert report["whole_run"] is False
    assert report["source"] == f"{tmp_path / 'm'}, 2.5 s between reads"
    assert figures["batches"] > 0 and 0.9 < figures["window_seconds"] < 10
    assert train_rank0(report)["verdict"] == "input-bound"


@pytest.mark.torch  # a training script writes the directory the doctor reads
@pytest.mark.slow
def test_the_sidecar_of_a_run_that_has_ended_gives_whole_run_figures_not_idle(
        ended: tuple[Path, dict[str, float]], tmp_path: Path) -> None:
    directory = copy_of(ended, tmp_path)
    exporter = Exporter(f"--metrics-dir={directory}", "--no-collector.gpu",
                        "--stale-after=3600")
    try:
        url = exporter.url + "/metrics"
        report = as_json(doctor("--url", url, "--interval", "0.3", "--format", "json"))
    finally:
        exporter.stop()
    d = train_rank0(report)
    assert report["whole_run"] is True
    assert report["source"] == (f"{url}, whole run (no batch in 0.3 s between scrapes: the "
                                "run has ended): rates per second of loop time")
    assert d["verdict"] == "input-bound" and d["figures"]["batches"] == ended[1]["batches"]
    assert d["figures"]["window_seconds"] == pytest.approx(loop_seconds(directory), rel=1e-9)


@pytest.mark.torch  # a training script writes the directory the doctor reads
@pytest.mark.slow
def test_samples_that_cannot_be_counted_are_unknown_not_zero(tmp_path: Path) -> None:
    # batch_size=None: the dataset's items are the batches, and a lone tensor beside an
    # index cannot say how many samples it holds, so the trainer exports no count.
    trained(tmp_path, n=8, delay=0.0, batch_size=None, epochs=1)
    directory = tmp_path / "m"
    assert cat.SAMPLES.name + "{" not in "".join(p.read_text() for p in directory.glob("*"))
    text = doctor("--metrics-dir", str(directory))
    assert "samples/s unknown" in text.stdout and " 0 samples/s" not in text.stdout
    figures = train_rank0(as_json(doctor("--metrics-dir", str(directory), "--format",
                                         "json")))["figures"]
    assert figures["samples"] is None and figures["samples_per_second"] is None
    assert figures["batches"] == 8


def test_top_shows_unknown_samples_as_a_dash_and_known_ones_as_a_rate() -> None:
    unknown = LoaderSignals("train", "0", seconds=2.0, batches=10)
    known = LoaderSignals("train", "1", seconds=2.0, batches=10, samples=40)
    assert unknown.samples_per_second is None and known.samples_per_second == 20
    assert top.HEADER.split()[-4] == "SAMPLE/S"  # then workers, /dev/shm and GPU
    assert top.row(unknown).split()[-4] == "-" and top.row(known).split()[-4] == "20"


def _scrape(at: float, batches: dict[str, float], fetch: float = 1.0, step: float = 3.0
            ) -> Scrape:
    """A reading of loaders by name (rank 0), each with the given fetch and step sums."""
    series: Series = {}
    for name, n in batches.items():
        lr: Labels = (("loader", name), ("rank", "0"))
        series[(cat.BATCHES.name, lr)] = n
        series[(cat.TIME.name + "_sum", (lr[0], ("phase", cat.PHASE_FETCH), lr[1]))] = fetch
        series[(cat.STEP.name + "_sum", lr)] = step
    return Scrape(at, series)


def test_a_run_with_any_loader_busy_keeps_its_window() -> None:
    w = window_of(_scrape(0, {"train": 5, "val": 3}), _scrape(2, {"train": 5, "val": 4}),
                  ended=True)
    assert not w.is_whole_run and w.seconds == 2
    assert {s.loader: s.batches for s in loaders(w)} == {"train": 0, "val": 1}


def test_a_run_whose_loaders_all_stopped_is_read_whole() -> None:
    first, second = _scrape(0, {"train": 5}), _scrape(2, {"train": 5}, fetch=1.5, step=2.5)
    w = window_of(first, second, ended=True)
    [s] = loaders(w)
    assert w.is_whole_run and (s.batches, s.seconds) == (5, 4.0)
    assert s.batches_per_second == 1.25 and s.stall_share == 1.5 / 4.0
    # Not known to have ended (its files are still written): idle in the window.
    assert not window_of(first, second, ended=False).is_whole_run


def test_a_reading_with_no_batches_at_all_stays_idle() -> None:
    w = window_of(_scrape(0, {"train": 0}), _scrape(2, {"train": 0}), ended=True)
    assert not w.is_whole_run and w.seconds == 2


def test_a_report_of_unknown_samples_says_unknown_and_null() -> None:
    s = LoaderSignals("train", "0", seconds=10, fetch_seconds=0.1, step_seconds=9,
                      batches=100, workers_configured=2)
    report = build_report("test", Machine(3, None, 1 << 30, 1 << 30, 1 << 30, "nvme", "/"),
                          [s], 1, whole_run=True)
    assert "samples/s unknown" in report.text()
    as_dict = report.as_dict()
    assert as_dict["whole_run"] is True
    assert as_dict["loaders"][0]["figures"]["samples_per_second"] is None  # type: ignore[index]


# A training script (fast samples, a 20 ms step, 2 persistent workers) that runs
# until a stop file appears, then exits normally; or until it is killed.
STEADY = """
import sys, time
from pathlib import Path
from dataloader_exporter import instrument
from support.torch_helpers import SleepDataset
loader = instrument.DataLoader(SleepDataset(64), batch_size=4, num_workers=2,
                               persistent_workers=True, name="train", metrics_dir=sys.argv[1])
stop = Path(sys.argv[2])
while not stop.exists():
    for _ in loader:
        time.sleep(0.02)
        if stop.exists():
            break
"""


def _steady(out: Path) -> tuple[subprocess.Popen[bytes], Path]:
    (out / "m").mkdir(parents=True)
    stop = out / "stop"
    with open(out / "train.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", STEADY, str(out / "m"), str(stop)],
                                cwd=REPO, env={**os.environ, "PYTHONPATH": "tests:."},
                                stdout=subprocess.DEVNULL, stderr=log)
    # Under way: a snapshot with batches and both workers alive.
    assert deadline_poll(lambda: any(
        f'{cat.WORKERS_ACTIVE.name}{{loader="train",rank="0"}} 2.0' in p.read_text()
        and f"{cat.BATCHES.name}{{" in p.read_text() for p in (out / "m").glob("*.prom")),
        timeout=60), (out / "train.log").read_text()
    return proc, stop


@pytest.mark.torch  # a training script writes the directory the doctor reads
@pytest.mark.slow
def test_a_trainer_killed_mid_epoch_ended_abruptly_one_that_exited_did_not(
        tmp_path: Path) -> None:
    """The same run, ended two ways: killed mid-epoch (SIGKILL, as the OOM killer or a
    scheduler does), its last snapshot has no exit time and the doctor says the run ended
    abruptly (exit 1, never "healthy"); exited normally, its last snapshot has one and the
    doctor finds nothing."""
    killed, stop = _steady(tmp_path / "killed")
    killed.kill()
    killed.wait(timeout=30)
    exited, stop = _steady(tmp_path / "exited")
    stop.touch()
    assert exited.wait(timeout=60) == 0, (tmp_path / "exited" / "train.log").read_text()
    for run in ("killed", "exited"):
        written_ago(tmp_path / run / "m", 60)
    [last] = (tmp_path / "exited" / "m").glob("*.prom")
    assert f'{cat.EXITED.name}{{rank="0"}}' in last.read_text()  # the process's, per rank

    result = doctor("--metrics-dir", str(tmp_path / "killed" / "m"), "--format", "json")
    assert result.returncode == 1, result.stderr
    d = train_rank0(as_json(result))
    [abrupt] = [f for f in d["findings"] if f["kind"] == "ended-abruptly"]
    assert "without a normal exit" in abrupt["message"], abrupt
    assert "2 workers were alive" in abrupt["message"], abrupt
    text = doctor("--metrics-dir", str(tmp_path / "killed" / "m")).stdout
    assert "ended without a normal exit" in text and "healthy" not in text.splitlines()[-1]
    # The same through the sidecar that serves the killed trainer's last file.
    exporter = Exporter(f"--metrics-dir={tmp_path / 'killed' / 'm'}", "--no-collector.gpu",
                        "--stale-after=3600")
    try:
        result = doctor("--url", exporter.url + "/metrics", "--interval", "0.3", "--format",
                        "json")
    finally:
        exporter.stop()
    assert result.returncode == 1, result.stderr
    kinds = [f["kind"] for f in train_rank0(as_json(result))["findings"]]
    assert "ended-abruptly" in kinds, result.stdout

    # (A short run: its first batch's wait for the workers may make it moderately
    # input-bound; what matters is that it ended normally.)
    report = as_json(doctor("--metrics-dir", str(tmp_path / "exited" / "m"), "--format",
                            "json"))
    assert not train_rank0(report)["findings"], report


def with_tuner(text: str, loader: str, stable: float, changes: dict[tuple[str, str], int]
               ) -> str:
    """A snapshot file's text with the loader tuner's series for `loader` (rank 0) added
    under their TYPE lines, as the trainer writes them for a tuned loader."""
    lr = f'loader="{loader}",rank="0"'
    lines = [f"{cat.TUNER_CHANGES.name}{{{lr},setting=\"{s}\",reason=\"{r}\"}} {n:.1f}"
             for (s, r), n in changes.items()]
    text = text.replace(f"# TYPE {cat.TUNER_CHANGES.name} counter\n",
                        f"# TYPE {cat.TUNER_CHANGES.name} counter\n" + "".join(
                            line + "\n" for line in lines))
    return text.replace(f"# TYPE {cat.TUNER_STABLE.name} gauge\n",
                        f"# TYPE {cat.TUNER_STABLE.name} gauge\n"
                        f"{cat.TUNER_STABLE.name}{{{lr},settings=\"num_workers,"
                        f"prefetch_factor\"}} {stable:.1f}\n")


def read_dir(directory: Path) -> Report:
    """The doctor's report on a directory, read in this process as the CLI reads it."""
    window, source = dirsource.window(dirsource.SnapshotDir(str(directory)), 10.0)
    return doctor_cli.build_report(window, source)


def test_a_tuned_loaders_files_say_the_tuner_its_settings_and_changes_and_keep_auto(
        tmp_path: Path) -> None:
    """A real trainer's file (loader t, 2 workers, exited) with the tuner's series added:
    the doctor reads them from the directory, says the tuner still tries (no advice on
    the settings it sets) or is stable, and its env line keeps auto."""
    real = real_snapshot("0", (("t", 2),), 4, None, True).decode()
    changes = {("num_workers", "starved"): 1, ("prefetch_factor", "bursty"): 1}
    for stable in (0.0, 1.0):
        directory = tmp_path / f"stable{stable:g}"
        directory.mkdir()
        (directory / "host-1-abcd.prom").write_text(with_tuner(real, "t", stable, changes))
        written_ago(directory, 60)
        report = read_dir(directory)
        [d] = report.diagnoses
        assert d.tuner is not None and d.tuner.changes == 2
        assert d.tuner.state == ("stable" if stable else "trying")
        assert (d.tuner.num_workers, d.tuner.prefetch_factor) == (2, 2)
        if not stable:
            assert not {"num_workers", "prefetch_factor"} & {
                r.setting for r in d.recommendations}
        assert env_line(report)[0].startswith(
            f"{ENV_SETTINGS}=t.num_workers=auto,t.prefetch_factor=auto")
    # The command itself, on the one still trying.
    text = doctor("--metrics-dir", str(tmp_path / "stable0"))
    assert text.returncode in (0, 1) and text.stderr == "", text.stderr
    assert ("\n  tuner: the loader tuner is still trying settings, now num_workers=2, "
            "prefetch_factor=2; 2 changes so far (num_workers: starved 1; prefetch_factor: "
            "bursty 1); no num_workers or prefetch_factor advice while it sets them\n"
            ) in text.stdout, text.stdout
    env = doctor("--metrics-dir", str(tmp_path / "stable0"), "--format", "env")
    assert env.returncode == 0 and env.stdout.startswith(
        f"{ENV_SETTINGS}=t.num_workers=auto,t.prefetch_factor=auto"), env
    plain = tmp_path / "untuned"
    plain.mkdir()
    (plain / "host-1-abcd.prom").write_text(real)
    written_ago(plain, 60)
    [d] = read_dir(plain).diagnoses
    assert d.tuner is None and "tuner:" not in read_dir(plain).text()
