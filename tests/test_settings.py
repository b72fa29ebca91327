"""DATALOADER_EXPORTER_SETTINGS: parsed with every problem named, formatted for the doctor,
and applied to instrument.DataLoader when it is built (zero-code mode: test_zerocode.py)."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from prometheus_client import CollectorRegistry
from support.torch_helpers import SleepDataset

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.core.envnames import getenv
from dataloader_exporter.core.facts.shm import SHM_PATH, shm_space
from dataloader_exporter.core.settings import (
    ENV_SETTINGS,
    Setting,
    SettingsError,
    format_settings,
    parse,
)

pytestmark = pytest.mark.torch


def test_the_documented_example_parses_to_loader_setting_value() -> None:
    assert parse("train.num_workers=8,train.prefetch_factor=4,*.persistent_workers=true") == (
        Setting("train", "num_workers", 8), Setting("train", "prefetch_factor", 4),
        Setting("*", "persistent_workers", True))


@pytest.mark.parametrize("line, problem", [
    ("train.nm_workers=8", "unknown setting 'nm_workers'"),
    ("train.num_workers=-1", "num_workers must be 0 or more"),
    ("train.num_workers=0,train.prefetch_factor=4", "train: prefetch_factor need workers"),
    ("train.prefetch_factor=0", "prefetch_factor must be 1 or more"),
    ("train.pin_memory=perhaps", "pin_memory expected true or false"),
    ("num_workers=8", "expected LOADER.SETTING=VALUE"),
    ("train.num_workers=2,train.num_workers=4", "train.num_workers is given twice"),
])
def test_each_bad_value_is_named_in_a_clear_message(line: str, problem: str) -> None:
    with pytest.raises(SettingsError) as e:
        parse(line)
    assert str(e.value).startswith(ENV_SETTINGS + ": ") and problem in str(e.value)


def test_every_problem_of_a_line_is_reported_together() -> None:
    with pytest.raises(SettingsError) as e:
        parse("a.num_workers=x,b.speed=2")
    assert "a.num_workers=x" in str(e.value) and "b.speed=2" in str(e.value)


def test_format_settings_gives_the_line_the_parser_reads() -> None:
    line = format_settings("train", {"persistent_workers": True, "num_workers": 8})
    assert line == "train.num_workers=8,train.persistent_workers=true"
    assert parse(line) == (Setting("train", "num_workers", 8),
                           Setting("train", "persistent_workers", True))
    with pytest.raises(SettingsError):
        format_settings("train", {"speed": 2})


@pytest.mark.parametrize("value", ["", "t.num_workers=2", "é ü", "a\udcffb"])
def test_the_environment_is_read_as_os_environ_has_it_now(
        monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """getenv reads os.environ's own table: a change made after import shows, a name
    removed is gone, and a value that is not UTF-8 comes back as os.environ gives it."""
    monkeypatch.setenv(ENV_SETTINGS, value)
    assert getenv(ENV_SETTINGS, "unset") == os.environ.get(ENV_SETTINGS, "unset") == value
    monkeypatch.delenv(ENV_SETTINGS)
    assert getenv(ENV_SETTINGS, "unset") == "unset"
    assert getenv(ENV_SETTINGS) == ""
    monkeypatch.setattr(os, "environ", {ENV_SETTINGS: value})  # another mapping in its place
    assert getenv(ENV_SETTINGS, "unset") == value


def test_settings_apply_to_an_instrumented_loader_when_it_is_built(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        registry: CollectorRegistry) -> None:
    monkeypatch.setenv(ENV_SETTINGS, "t.num_workers=1,t.prefetch_factor=3,*.pin_memory=false,"
                       "*.persistent_workers=true")
    caplog.set_level(logging.WARNING, "dataloader_exporter.instrument")
    loader = instrument.DataLoader(SleepDataset(4), batch_size=2, name="t", registry=registry,
                                   pin_memory=True)
    assert (loader.num_workers, loader.prefetch_factor, loader.pin_memory,
            loader.persistent_workers) == (1, 3, False, True)
    assert sum(1 for _ in loader) == 2
    labels = {"loader": "t", "rank": "0", "num_workers": "1", "batch_size": "2",
              "prefetch_factor": "3", "pin_memory": "false", "persistent_workers": "true",
              "gpu_uuid": "", "dev_shm_bytes": str(shm_space(SHM_PATH).size)}
    assert registry.get_sample_value(cat.INFO.name, labels) == 1
    said = caplog.text
    assert "dataloader 't': num_workers=1 from DATALOADER_EXPORTER_SETTINGS (was 0)" in said
    assert "dataloader 't': pin_memory=False from DATALOADER_EXPORTER_SETTINGS (was True)" in said
    # A loader without workers keeps going: settings that need workers are not applied to it.
    other = instrument.DataLoader(SleepDataset(2), name="u", registry=registry)
    assert other.persistent_workers is False
    assert "u': DATALOADER_EXPORTER_SETTINGS.persistent_workers=True not applied" in caplog.text


def test_num_workers_zero_drops_the_loaders_own_worker_settings(
        monkeypatch: pytest.MonkeyPatch, registry: CollectorRegistry) -> None:
    monkeypatch.setenv(ENV_SETTINGS, "t.num_workers=0")
    loader = instrument.DataLoader(SleepDataset(2), name="t", registry=registry, num_workers=2,
                                   prefetch_factor=4, persistent_workers=True)
    assert (loader.num_workers, loader.prefetch_factor, loader.persistent_workers) == (
        0, None, False)


def test_a_bad_line_fails_when_the_loader_is_built_not_mid_run(
        monkeypatch: pytest.MonkeyPatch, registry: CollectorRegistry) -> None:
    monkeypatch.setenv(ENV_SETTINGS, "t.num_workers=-1")
    with pytest.raises(SettingsError, match="num_workers must be 0 or more"):
        instrument.DataLoader(torch.utils.data.TensorDataset(torch.ones(2)), name="t",
                              registry=registry)
