"""The exporter command: configuration errors, endpoints, signals, and no torch."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.procs import REPO, Exporter, http_get

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.exporter import config
from dataloader_exporter.exporter.collectors import trainer


def build(*argv: str, env: dict[str, str] | None = None) -> config.Config:
    parser = argparse.ArgumentParser()
    config.add_flags(parser)
    args, unknown = parser.parse_known_args(list(argv))
    assert not unknown
    return config.build(args, env or {})


def problems(*argv: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(config.ConfigError) as err:
        build(*argv, env=env)
    return err.value.problems


def run_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dataloader_exporter", *argv], capture_output=True,
                          text=True, timeout=30, cwd=REPO, env={**os.environ, **(env or {})})


def test_defaults_serve_everything_but_the_trainer_on_the_documented_port() -> None:
    cfg = build()
    assert (cfg.host, cfg.port) == ("0.0.0.0", config.DEFAULT_PORT)
    assert cfg.collectors == {"gpu", "shm", "host"} and cfg.stale_after == 30


def test_environment_variables_configure_and_flags_win(tmp_path: Path) -> None:
    env = {"DATALOADER_EXPORTER_WEB_LISTEN_ADDRESS": "127.0.0.1:9999",
           "DATALOADER_EXPORTER_DIR": str(tmp_path),
           "DATALOADER_EXPORTER_COLLECTOR_GPU": "false",
           "DATALOADER_EXPORTER_STALE_AFTER": "12.5",
           "DATALOADER_EXPORTER_SHM_PATH": "/tmp"}
    cfg = build(env=env)
    assert (cfg.host, cfg.port, cfg.metrics_dir, cfg.stale_after, cfg.shm_path) == (
        "127.0.0.1", 9999, str(tmp_path), 12.5, "/tmp")
    assert cfg.collectors == {"trainer", "shm", "host"}
    cfg = build("--web.listen-address=[::1]:8000", "--collector.gpu", "--stale-after=3",
                env=env)
    assert (cfg.host, cfg.port, cfg.stale_after) == ("::1", 8000, 3.0)
    assert "gpu" in cfg.collectors and cfg.listen_address == "[::1]:8000"
    cfg = build("--stale-after=2m", "--web.idle-timeout=500ms", "--web.max-connections=7",
                env={"DATALOADER_EXPORTER_WEB_READ_HEADER_TIMEOUT": "3s"})
    assert cfg.stale_after == 120 and cfg.limits.idle_timeout == 0.5
    assert (cfg.limits.max_connections, cfg.limits.read_header_timeout) == (7, 3.0)
    assert (cfg.max_file_bytes, cfg.max_series, cfg.remove_after) == (
        trainer.DEFAULT_MAX_FILE_BYTES, trainer.DEFAULT_MAX_SERIES, None)
    cfg = build("--collector.trainer.max-file-bytes=1000", "--collector.trainer.max-series=9",
                env={"DATALOADER_EXPORTER_COLLECTOR_TRAINER_REMOVE_AFTER": "never"})
    assert (cfg.max_file_bytes, cfg.max_series, cfg.remove_after) == (1000, 9, float("inf"))
    assert build("--collector.trainer.remove-after=1h").remove_after == 3600
    assert build().keep_failed_for == trainer.KEEP_FAILED_FOR == 7 * 86400
    assert build("--collector.trainer.keep-failed-for=3d").keep_failed_for == 3 * 86400
    assert build(env={"DATALOADER_EXPORTER_COLLECTOR_TRAINER_KEEP_FAILED_FOR": "1w"}
                 ).keep_failed_for == 7 * 86400


@pytest.mark.parametrize(("argv", "env", "expected"), [
    (["--web.listen-address=localhost"], {}, "is not [HOST]:PORT"),
    (["--web.listen-address=:70000"], {}, "port must be 0-65535"),
    (["--web.listen-address=:http"], {}, "port must be 0-65535"),
    (["--web.listen-address=::1:80"], {}, "IPv6 host in brackets"),
    ([], {"DATALOADER_EXPORTER_WEB_LISTEN_ADDRESS": "nope"}, "is not [HOST]:PORT"),
    (["--stale-after=-5"], {}, "positive duration"),
    (["--stale-after=0"], {}, "positive duration"),
    (["--stale-after=soon"], {}, "positive duration"),
    ([], {"DATALOADER_EXPORTER_STALE_AFTER": "-1"}, "positive duration"),
    (["--web.idle-timeout=0s"], {}, "--web.idle-timeout '0s': must be a positive duration"),
    ([], {"DATALOADER_EXPORTER_WEB_READ_HEADER_TIMEOUT": "fast"}, "positive duration"),
    (["--web.max-connections=0"], {}, "positive whole number"),
    (["--collector.trainer.max-series=lots"], {}, "positive whole number"),
    ([], {"DATALOADER_EXPORTER_COLLECTOR_TRAINER_MAX_FILE_BYTES": "-1"}, "whole number"),
    (["--stale-after=60", "--collector.trainer.remove-after=30s"], {},
     "must not be shorter than --stale-after (60s)"),
    (["--web.config.file=/no/such/web.yml"], {}, "--web.config.file"),
    (["--log.level=loud"], {}, "must be one of debug, info, warn, error"),
    ([], {"DATALOADER_EXPORTER_COLLECTOR_SHM": "maybe"}, "must be true or false"),
    (["--collector.trainer"], {}, "needs --metrics-dir"),
    (["--metrics-dir=/no/such/dir"], {}, "no such directory"),
])
def test_each_bad_flag_or_variable_is_named(argv: list[str], env: dict[str, str],
                                            expected: str) -> None:
    found = problems(*argv, env=env)
    assert len(found) == 1 and expected in found[0], found


def test_all_problems_are_reported_together_with_exit_status_2_and_nothing_listens() -> None:
    result = run_cli("serve", "--bogus", "--web.listen-address=x", "--stale-after=-1",
                     "--metrics-dir=/no/such/dir")
    assert result.returncode == 2
    err = result.stderr
    for expected in ("unknown flag '--bogus'", "is not [HOST]:PORT", "positive duration",
                     "no such directory"):
        assert expected in err, err
    assert "listening" not in err


def test_a_metrics_dir_that_is_a_file_is_rejected(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("")
    assert "not a directory" in problems(f"--metrics-dir={f}")[0]
    result = run_cli("serve", f"--metrics-dir={f}", "--web.max-connections=\u00b2")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"--metrics-dir '{f}': not a directory" in result.stderr
    assert "--web.max-connections '\u00b2': must be a positive whole number" in result.stderr


def test_an_unreadable_metrics_dir_is_rejected_with_exit_status_2(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0)
    argv = [sys.executable, "-m", "dataloader_exporter", "serve", f"--metrics-dir={locked}"]
    if os.geteuid() == 0:  # root reads everything: drop the capabilities that allow it
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("needs setpriv (util-linux) to test as root")
        argv = [setpriv, "--bounding-set=-dac_override,-dac_read_search", *argv]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=REPO)
        assert result.returncode == 2, result.stderr
        assert "not readable" in result.stderr
    finally:
        locked.chmod(0o700)


def test_a_port_in_use_is_a_clear_error() -> None:
    first = Exporter("--no-collector.gpu")
    try:
        result = run_cli("serve", f"--web.listen-address={first.address}", "--no-collector.gpu")
        assert result.returncode == 2 and "cannot listen on" in result.stderr
    finally:
        first.stop()


def test_endpoints_metrics_index_health_and_404() -> None:
    exp = Exporter("--no-collector.gpu")
    try:
        assert http_get(exp.url + "/")[0] == 200 and "/metrics" in http_get(exp.url + "/")[1]
        assert http_get(exp.url + "/-/healthy") == (200, "OK\n")
        assert http_get(exp.url + "/favicon.ico")[0] == 404
        body = exp.metrics()
        assert cat.SHM_SIZE.name in body and cat.HOST_MEMORY_TOTAL.name in body
        assert cat.BUILD_INFO.name in body and cat.GPU_UTILIZATION.name not in body
    finally:
        exp.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_shuts_the_exporter_down_cleanly_within_two_seconds(sig: int) -> None:
    exp = Exporter("--no-collector.gpu")
    exp.metrics()
    start = time.monotonic()
    exp.proc.send_signal(sig)
    code = exp.proc.wait(timeout=5)
    elapsed = time.monotonic() - start
    exp.close()
    assert elapsed < 2.0
    assert code == 0, "".join(exp.lines)


def test_the_exporter_process_never_imports_torch(tmp_path: Path) -> None:
    poison = tmp_path / "poison" / "torch"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise ImportError('the exporter imported torch')\n")
    (tmp_path / "metrics").mkdir()
    exp = Exporter(f"--metrics-dir={tmp_path / 'metrics'}",
                   env={"PYTHONPATH": f"{poison.parent}{os.pathsep}{REPO}"})
    try:
        body = exp.metrics()
        assert cat.COLLECTOR_UP.name in body
        assert exp.proc.poll() is None
        assert not any("imported torch" in line for line in exp.lines)
    finally:
        assert exp.stop() == 0


def test_help_names_every_flag() -> None:
    out = run_cli("serve", "--help").stdout
    for flag in ("--web.listen-address", "--metrics-dir", "--shm-path", "--stale-after",
                 "--log.level", "--collector.gpu", "--no-collector.gpu", "--collector.trainer",
                 "--web.config.file", "--web.max-connections", "--web.read-header-timeout",
                 "--web.idle-timeout", "--collector.trainer.max-file-bytes",
                 "--collector.trainer.max-series", "--collector.trainer.remove-after"):
        assert flag in out


def test_config_namespace_without_flags_is_all_defaults() -> None:
    assert config.build(argparse.Namespace(), {}).port == config.DEFAULT_PORT
