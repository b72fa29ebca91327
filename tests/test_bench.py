"""The benchmarks and the prepared GPU check still start: a moved import once broke them
silently (no test ran them, and mypy does not read bench/). On a machine with a GPU the
GPU check runs and must pass."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.procs import REPO

from dataloader_exporter.core.tuner.rules import REASONS

pytestmark = [pytest.mark.torch, pytest.mark.slow]


@pytest.mark.parametrize("script", ["overhead.py", "scrape.py", "proc_sampling.py", "tuner.py",
                                    "background.py", "hot_floor.py", "short_lived.py",
                                    "epoch_instructions.py", "cowscan.py",
                                    "tuner_libraries.py"])
def test_each_benchmark_starts_and_explains_itself(script: str) -> None:
    result = subprocess.run([sys.executable, str(REPO / "bench" / script), "--help"],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "--quick" in result.stdout


def test_the_tuner_benchmark_reports_each_class_its_fixed_counts_and_the_tuned_run() -> None:
    """One class for a second a setting, structure only: on these cores the figures are
    noise."""
    result = subprocess.run([sys.executable, str(REPO / "bench" / "tuner.py"), "--quick",
                             "--classes", "cpu-trivial", "--fixed", "1", "--tuned", "3"],
                            capture_output=True, text=True, timeout=180, cwd=REPO)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    summary = json.loads(lines[-1])
    [(name, got)] = summary["results"].items()
    counts = [str(n) for n in range(summary["cores"] + 2)]  # 0 .. past the cores
    assert name == "cpu-trivial" and list(got["fixed"]) == counts, summary
    assert str(got["best"]) in counts and got["ratio"] > 0, summary
    # The best as chosen in each pass, its rate read from the other; the fastest mean beside.
    assert all(str(n) in counts for n in got["chosen"]) and got["ratio_to_max"] > 0, summary
    assert got["tuned_settings"]["num_workers"] >= 0, got
    # Its worker count's own fixed rate over the best: whether it chose well, apart from
    # how its run went.
    held = str(got["tuned_settings"]["num_workers"])
    assert (got["choice"] is None) is (held not in counts) and (
        got["choice"] is None or got["choice"] > 0), got
    for change in got["changes"]:  # setting/reason: the tuner's metric's labels
        setting, reason = change.split("/")
        assert setting in ("num_workers", "prefetch_factor") and reason in REASONS, got
    assert any(line.split()[:3] == ["cpu-trivial", "fixed", "samples/s"] for line in lines), lines
    assert set(summary["checks"]) == {"cpu-trivial: tuned/best >= 0.90"}, summary
    for label, ok in summary["checks"].items():
        assert f"{'PASS' if ok else 'FAIL'}  {label}" in lines, lines


def test_the_data_library_benchmark_decodes_real_samples_in_workers() -> None:
    """The tokenizers class (a Rust tokenizer trained in the run, its samples read by
    forked workers) for half a second a setting: structure only, as above."""
    result = subprocess.run([sys.executable, str(REPO / "bench" / "tuner_libraries.py"),
                             "--classes", "tokenizers", "--fixed", "0.5", "--tuned", "2",
                             "--runs", "1"],
                            capture_output=True, text=True, timeout=180, cwd=REPO)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.splitlines()[-1])
    got = summary["results"]["tokenizers"]
    counts = [str(n) for n in range(summary["cores"] + 2)]
    assert list(got["fixed"]) == counts and all(v > 0 for v in got["fixed"].values()), got
    assert got["tuned"] > 0 and set(summary["checks"]) == {"tokenizers: tuned/best >= 0.90"}


def test_classes_run_again_are_judged_on_the_median_of_their_runs(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """bench/tuner_libraries.py --runs: where fixed settings tie within the noise, one
    run's best is the luckiest of them; the goal is judged on the median of the runs'
    ratios, each run printed."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import tuner
    finally:
        sys.path.remove(str(REPO / "bench"))
    runs = iter([(0.70, 0.78, 0.88), (0.93, 0.90, 1.12), (0.97, 0.93, None),
                 (0.85, 0.85, 1.0)])

    def canned(kind: object, fixed_s: float, tuned_s: float) -> dict[str, object]:
        ratio, to_max, choice = next(runs)
        return {"fixed": {"0": 4000.0, "2": 3900.0}, "best": 0, "choice": choice,
                "chosen": [0, 2], "tuned": 4000.0 * ratio,
                "tuned_settings": {"num_workers": 0, "prefetch_factor": None},
                "ratio": ratio, "ratio_to_max": to_max, "changes": []}

    monkeypatch.setattr(tuner, "one_class", canned)
    kind = tuner.kinds(2)["cpu-trivial"]
    r = tuner.class_runs(kind, 1.0, 1.0, 3)
    checks: dict[str, bool] = {}
    tuner.report_class("cpu-trivial", r, checks)
    # Not the first, the last or the mean (0.87) of the runs' ratios.
    assert (r["ratio"], r["ratio_to_max"], r["choice"]) == (0.93, 0.90, 1.0), r
    assert len(r["runs"]) == 3 and checks == {"cpu-trivial: tuned/best >= 0.90": True}
    out = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("cpu-trivial    fixed samples/s") for line in out) == 3, out
    assert out[-1].startswith("cpu-trivial    median of 3 runs: tuned/best 0.93"), out
    one = tuner.class_runs(kind, 1.0, 1.0, 1)  # one run: judged on it alone
    tuner.report_class("cpu-trivial", one, checks)
    assert one["ratio"] == 0.85 and "runs" not in one
    assert checks == {"cpu-trivial: tuned/best >= 0.90": False}
    assert not any("median" in line for line in capsys.readouterr().out.splitlines())


CHECKS = ("events", "bytes", "overlap", "nvml", "uuid")  # bench/gpu_check.py's


def test_the_gpu_check_passes_on_a_gpu_and_skips_clearly_without() -> None:
    """On a machine with CUDA every check passes; elsewhere it imports everything, says
    it skipped, and exits 0."""
    cuda = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert cuda.returncode == 0, cuda.stderr
    result = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py")],
                            capture_output=True, text=True, timeout=240, cwd=REPO)
    if cuda.stdout.strip() != "True":
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("SKIP: no CUDA"), result.stdout
        return
    lines = result.stdout.splitlines()
    assert result.returncode == 0, (result.stdout, result.stderr[-4000:])
    for check in CHECKS:  # one line each: PASS  name: {details}
        assert any(line.startswith(f"PASS  {check}: ") for line in lines), (check, lines)
    summary = json.loads(lines[-1])
    assert summary["checks"] == dict.fromkeys(CHECKS, "PASS"), summary


def test_short_epoch_classes_run_again_are_judged_on_the_median_of_their_runs(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """bench/tuner.py --runs: one run's ratio over a few one-second epochs spreads as wide
    as its A/A control; the goal is judged on the median of the runs, each run printed."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import _tuner_common as common
    finally:
        sys.path.remove(str(REPO / "bench"))
    runs = iter([(0.79, 0.85, 0.90, True), (0.93, 0.99, 0.97, True),
                 (1.09, 1.01, 1.05, False)])

    def canned(name: str, script: str) -> dict[str, object]:
        true, auto, aa, same = next(runs)
        return {"rates": {"fixed-32": 4000.0, "auto": 4000.0 * auto, "true": 4000.0 * true},
                "best": "fixed-32", "ratio": {"auto": auto, "true": true},
                "ratio_to_max": {"auto": auto, "true": true}, "aa": aa,
                "same": {"auto": True, "true": same}}

    monkeypatch.setattr(common, "short_class", canned)
    r = common.short_runs("storage-epochs", "tuner.py", 3)
    checks: dict[str, bool] = {}
    common.report_short("storage-epochs", r, checks)
    assert r["ratio"] == {"auto": 0.99, "true": 0.93} and r["aa"] == 0.97, r
    assert len(r["runs"]) == 3 and r["same"] == {"auto": True, "true": False}
    assert checks == {
        "storage-epochs persistent_workers=auto: tuned/best >= 0.90": True,
        "storage-epochs persistent_workers=auto: same batches as untuned": True,
        "storage-epochs persistent_workers=true: tuned/best >= 0.90": True,
        "storage-epochs persistent_workers=true: same batches as untuned": False}
    out = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("storage-epochs samples/s over the last") for line in out) == 3
    assert out[-1].startswith("storage-epochs median of 3 runs: tuned/best"), out


def test_the_short_lived_benchmark_lists_the_functions_a_round_runs_beyond_bares() -> None:
    """--functions: what instrumentation runs in a 2-worker round that torch's loader does
    not; torch's own loader code runs in bare's rounds too, so none of it is listed."""
    result = subprocess.run([sys.executable, str(REPO / "bench" / "short_lived.py"),
                             "--functions"], capture_output=True, text=True, timeout=180,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for variant in ("instrumented", "zero-code"):
        head = next(line for line in out.splitlines() if line.startswith(variant + ":"))
        assert int(head.split()[1]) > 0
    assert "instrument/iter_start.py" in out and "instrumented_iter" in out
    assert "torch/utils/data/dataloader.py" not in out


def test_the_short_lived_benchmark_says_its_case_with_workers_needs_one() -> None:
    """--workers 0 would run the case without workers twice under a name that says
    otherwise: refused before any round, with the reason."""
    result = subprocess.run([sys.executable, str(REPO / "bench" / "short_lived.py"),
                             "--workers", "0"], capture_output=True, text=True, timeout=120,
                            cwd=REPO)
    assert result.returncode == 2 and result.stdout == "", result
    assert "--workers: at least 1" in result.stderr
