"""The snapshot writer's own encoding and file handling: the bytes prometheus_client's
generate_latest would write for the same families, written atomically."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from torch.utils.data import TensorDataset

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.exporter.exposition import text
from dataloader_exporter.instrument.snapshot_writer import SnapshotWriter

pytestmark = pytest.mark.torch


class _Families:
    """A registry-like holder of families collected once."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        return self.families


@pytest.mark.parametrize("workers", [0, 2])
def test_a_snapshot_is_the_text_prometheus_client_writes_for_the_same_families(
        workers: int) -> None:
    registry = CollectorRegistry()
    loader = instrument.DataLoader(TensorDataset(torch.arange(16.0)), batch_size=4,
                                   num_workers=workers, name="enc", registry=registry)
    for _ in loader:
        pass
    families = list(instrument.hub_for(registry)._snapshot_registry().collect())
    assert families
    assert text(families) == generate_latest(_Families(families))


def test_a_write_makes_its_directory_again_and_leaves_no_temporary(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    for _ in instrument.DataLoader(TensorDataset(torch.arange(4.0)), name="enc",
                                   registry=registry):
        pass
    directory = tmp_path / "gone"
    writer = SnapshotWriter(instrument.hub_for(registry)._snapshot_registry(),
                            str(directory), 1.0)
    assert writer.write()
    os.remove(writer.path)
    os.rmdir(directory)
    assert writer.write()
    assert os.listdir(directory) == [os.path.basename(writer.path)]
    assert cat.BATCHES.name.encode() in Path(writer.path).read_bytes()


def test_a_failed_write_leaves_no_temporary(tmp_path: Path) -> None:
    writer = SnapshotWriter(CollectorRegistry(), str(tmp_path), 1.0)
    os.mkdir(writer.path)  # a directory where the file goes: the rename fails
    assert not writer.write()
    assert os.listdir(tmp_path) == [os.path.basename(writer.path)]
