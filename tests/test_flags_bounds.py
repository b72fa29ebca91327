"""Bounds on flags and settings: every bad listen address, count or setting is
exit status 2 with one line, the log names the address bound, and a 100 kB loader name is
cut short in log lines (never in labels)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from support.procs import REPO, Exporter
from support.torch_helpers import SleepDataset

from dataloader_exporter import instrument
from dataloader_exporter.core.settings import (
    ENV_SETTINGS,
    LOG_NAME_CHARS,
    SettingsError,
    log_name,
    parse,
)
from dataloader_exporter.exporter import config
from dataloader_exporter.exporter.serve_cli import bound_address

pytestmark = pytest.mark.torch


def serve(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dataloader_exporter", "serve",
                           "--no-collector.gpu", *argv], capture_output=True, text=True,
                          timeout=30, cwd=REPO)


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a run that exited 2."""
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("dataloader-exporter") and "Traceback" not in result.stderr
    return lines[0]


def build(*argv: str) -> config.Config:
    parser = argparse.ArgumentParser()
    config.add_flags(parser)
    return config.build(parser.parse_args(list(argv)), {})


@pytest.mark.parametrize(("address", "expected"), [
    ("a" * 70 + ":9478", "longer than 63 characters"),
    (".".join(["a" * 60] * 5) + ":9478", "the host name is 304 characters, over 253"),
    ("a..b:9478", "each dot-separated label is 1 to 63"),
    ("localhost", "is not [HOST]:PORT"),
    ("[not-v6]:9478", "brackets hold an IPv6 address only"),
    ("[127.0.0.1]:9478", "brackets hold an IPv6 address only"),
    (":70000", "port must be 0-65535"),
    (":" + "9" * 5000, "port must be 0-65535"),
    ("h\u00e9llo.example:9478", "the host must be ASCII"),
    ("\u0661\u0662\u0667.0.0.1:9478", "the host must be ASCII"),
])
def test_a_bad_listen_address_is_exit_status_2_with_one_line(address: str,
                                                             expected: str) -> None:
    line = one_error_line(serve(f"--web.listen-address={address}"))
    assert expected in line and len(line) < 400, line


def test_a_listen_address_that_cannot_be_bound_is_exit_status_2_with_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_error_line(serve(f"--web.listen-address=127.0.0.1:{port}"))
    assert f"cannot listen on 127.0.0.1:{port}" in line
    # TEST-NET-1 (RFC 5737): no host has it, so it cannot be assigned.
    assert "cannot listen on 192.0.2.1:0" in one_error_line(
        serve("--web.listen-address=192.0.2.1:0"))
    # .invalid (RFC 6761) never resolves.
    assert "cannot listen on name.invalid:0" in one_error_line(
        serve("--web.listen-address=name.invalid:0"))


def test_good_listen_addresses_still_parse() -> None:
    assert config.parse_address(":9478") == ("0.0.0.0", 9478)
    assert config.parse_address("[::]:0") == ("::", 0)
    assert config.parse_address("[fe80::1%eth0]:1") == ("fe80::1%eth0", 1)
    assert config.parse_address("my_sidecar.svc.cluster.local.:80")[0] == (
        "my_sidecar.svc.cluster.local.")
    assert config.parse_address("a" * 63 + ".example:80")[1] == 80


def test_the_log_names_the_address_bound_not_the_loopback() -> None:
    assert (build().host, build().port) == ("0.0.0.0", config.DEFAULT_PORT)
    exp = Exporter("--no-collector.gpu", "--web.listen-address=:0")  # the default, any port
    try:
        said = "".join(exp.lines)
        assert exp.address.startswith("0.0.0.0:"), said
        assert f"listening on http://{exp.address} (every IPv4 interface)" in said, said
        assert "127.0.0.1" not in said and exp.metrics()
    finally:
        assert exp.stop() == 0


def test_a_wildcard_address_is_named_as_every_interface_of_its_family() -> None:
    def handle(host: str) -> SimpleNamespace:
        return SimpleNamespace(host=host, port=9478, scheme="http")

    assert bound_address(handle("0.0.0.0")) == (
        "http://0.0.0.0:9478 (every IPv4 interface)")
    assert bound_address(handle("::")) == (
        "http://[::]:9478 (every IPv6 interface)")
    assert bound_address(handle("127.0.0.1")) == "http://127.0.0.1:9478"


@pytest.mark.parametrize("argv", [
    ["--web.max-connections=\u0663"],  # Arabic-Indic 3: int() reads it
    ["--web.max-connections=\uff18"],  # fullwidth 8
    ["--web.max-connections=" + "9" * 5000],  # past int()'s 4300 digits
    ["--stale-after=\u0663s"],
    ["--stale-after=1" + "0" * 400],  # float() gives inf
])
def test_counts_and_durations_take_ascii_digits_and_finite_values(argv: list[str]) -> None:
    with pytest.raises(config.ConfigError) as e:
        build(*argv)
    assert len(e.value.problems) == 1 and len(e.value.problems[0]) < 200


@pytest.mark.parametrize(("line", "problem"), [
    ("t.num_workers=99999999999999999999", "'t.num_workers=99999999999999999999': num_workers "
                                            "must be 1024 or less"),
    ("t.num_workers=1025", "num_workers must be 1024 or less"),
    ("t.prefetch_factor=1000000000", "prefetch_factor must be 1024 or less"),
    ("t.num_workers=\u0663", "num_workers expected a whole number (digits 0-9)"),
    ("t.prefetch_factor=\uff18", "prefetch_factor expected a whole number (digits 0-9)"),
    ("t.num_workers=" + "9" * 100_000, "num_workers must be 1024 or less"),
    ("t.num_workers=-" + "9" * 100_000, "num_workers must be 0 or more"),
])
def test_settings_take_ascii_digits_up_to_the_maxima(line: str, problem: str) -> None:
    with pytest.raises(SettingsError) as e:
        parse(line)
    assert problem in str(e.value) and len(str(e.value)) < 300, str(e.value)[:300]


def test_settings_at_the_maxima_are_taken() -> None:
    assert [s.value for s in parse("t.num_workers=1024,t.prefetch_factor=+1024")] == [1024, 1024]


def test_a_setting_over_its_maximum_stops_the_run_command_with_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dataloader_exporter", "run", "--settings",
         "t.num_workers=99999999999999999999", "--", sys.executable, "-c", "pass"],
        capture_output=True, text=True, timeout=60, cwd=REPO, env=dict(os.environ))
    line = one_error_line(result)
    assert "t.num_workers=99999999999999999999': num_workers must be 1024 or less" in line


def test_log_name_cuts_a_long_name_and_says_its_length() -> None:
    assert log_name("train") == "train"
    assert log_name("a" * LOG_NAME_CHARS) == "a" * LOG_NAME_CHARS
    assert log_name("a" * 100_000) == "a" * LOG_NAME_CHARS + "\u2026(100000 chars)"


def test_a_100_kb_loader_name_is_cut_in_log_lines_but_whole_in_labels(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        registry: CollectorRegistry) -> None:
    name = "n" * 100_000
    monkeypatch.setenv(ENV_SETTINGS, "*.pin_memory=false")
    caplog.set_level(logging.INFO, "dataloader_exporter.instrument")
    loader = instrument.DataLoader(SleepDataset(4), batch_size=2, name=name, registry=registry,
                                   pin_memory=True)
    assert sum(1 for _ in loader) == 2
    said = [r.getMessage() for r in caplog.records
            if r.name.startswith("dataloader_exporter.instrument")]
    assert any(f"dataloader '{log_name(name)}': pin_memory=False from" in m for m in said), said
    assert any(f"dataloader '{log_name(name)}': num_workers=0" in m for m in said), said
    assert all(len(m) < 2000 for m in said)
    labels = {s.labels.get("loader") for m in registry.collect() for s in m.samples}
    assert name in labels
