"""The committed trainer snapshot files (tests/trainer_snapshots/) that the sidecar's tests
read without torch still have the shape of what instrument's SnapshotWriter writes today:
the same families, types and help texts, and the same labels on each sample name. Values,
timestamps and series whose presence depends on timing (a worker read too briefly) are
left out. When this fails, rewrite them: `.venv/bin/python tests/support/real_snapshots.py`."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.real_snapshots import CASES, Case, file_name, real_snapshot
from support.torch_helpers import write_real_snapshot

pytestmark = pytest.mark.torch

Families = dict[str, tuple[str, str]]
Labels = dict[str, set[tuple[str, ...]]]


def shape(data: bytes) -> tuple[Families, Labels]:
    families: Families = {}
    labels: Labels = {}
    for family in text_string_to_metric_families(data.decode()):
        families[family.name] = (family.type, family.documentation)
        for s in family.samples:
            labels.setdefault(s.name, set()).add(tuple(sorted(s.labels)))
    return families, labels


@pytest.mark.parametrize("case", CASES, ids=file_name)
def test_the_committed_snapshot_has_the_shape_the_writer_writes_today(case: Case) -> None:
    rank, loaders, batches, first, exited = case
    committed, committed_labels = shape(real_snapshot(rank, loaders, batches, first, exited))
    fresh, fresh_labels = shape(write_real_snapshot(rank, loaders, batches, first, exited))
    hint = ("rewrite tests/trainer_snapshots/ (python tests/support/real_snapshots.py); "
            f"{file_name(case)}")
    assert committed == fresh, (hint, diff(committed, fresh))
    both = committed_labels.keys() & fresh_labels.keys()
    assert {n: committed_labels[n] for n in both} == {n: fresh_labels[n] for n in both}, hint


def diff(committed: dict[str, Any], fresh: dict[str, Any]) -> dict[str, Any]:
    return {name: (committed.get(name), fresh.get(name))
            for name in committed.keys() | fresh.keys() if committed.get(name) != fresh.get(name)}
