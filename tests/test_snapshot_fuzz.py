"""Mutated copies of a real snapshot never damage another file's series or the exposition.

300 seeded mutations (cuts at byte and line boundaries, byte flips, lines duplicated,
deleted or swapped, edited types, names, labels and values, foreign lines) of a real
snapshot, each served beside a good file: the good file's series stay exactly as they
are, the mutated file is served whole or not at all, and both of prometheus_client's
parsers accept every exposition. About 3 s on 2 cores.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families as text_families
from support.real_snapshots import real_snapshot

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.exporter import exposition
from dataloader_exporter.exporter.collectors.snapshot import Rejected, Snapshot
from dataloader_exporter.exporter.collectors.supervisor import Supervisor
from dataloader_exporter.exporter.collectors.trainer import TrainerCollector

pytestmark = pytest.mark.slow

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]
TRAINER_NAMES = {s for m in cat.ALL if m.source == cat.TRAINER for s in cat.series_names(m)}
GOOD_OWNER = (("loader", "t"), ("rank", "0"))


def series(families: Iterable[Metric]) -> Series:
    out: Series = {}
    for fam in families:
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def trainer_series(families: Iterable[Metric]) -> Series:
    return {k: v for k, v in series(families).items() if k[0] in TRAINER_NAMES}


def owner(key: tuple[str, tuple[tuple[str, str], ...]]) -> tuple[tuple[str, str], ...]:
    return tuple(p for p in key[1] if p[0] in ("loader", "rank"))


def same_series(a: Series, b: Series) -> bool:
    return a.keys() == b.keys() and all(
        a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


def lines_of(data: bytes) -> list[bytes]:
    return data.splitlines(keepends=True)


def cut_at_byte(rng: random.Random, data: bytes) -> bytes:
    return data[:rng.randrange(len(data))]


def cut_at_line(rng: random.Random, data: bytes) -> bytes:
    lines = lines_of(data)
    return b"".join(lines[:rng.randrange(len(lines))])


def flip_byte(rng: random.Random, data: bytes) -> bytes:
    i = rng.randrange(len(data))
    return data[:i] + bytes([data[i] ^ rng.randrange(1, 256)]) + data[i + 1:]


def duplicate_line(rng: random.Random, data: bytes) -> bytes:
    lines = lines_of(data)
    i = rng.randrange(len(lines))
    return b"".join(lines[:i + 1] + lines[i:])


def delete_line(rng: random.Random, data: bytes) -> bytes:
    lines = lines_of(data)
    del lines[rng.randrange(len(lines))]
    return b"".join(lines)


def swap_lines(rng: random.Random, data: bytes) -> bytes:
    lines = lines_of(data)
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    lines[i], lines[j] = lines[j], lines[i]
    return b"".join(lines)


def edit_type(rng: random.Random, data: bytes) -> bytes:
    lines = lines_of(data)
    at = [i for i, line in enumerate(lines) if line.startswith(b"# TYPE ")]
    i = rng.choice(at)
    head = lines[i].rsplit(b" ", 1)[0]
    new = rng.choice([b"counter", b"gauge", b"histogram", b"summary", b"untyped", b"info"])
    lines[i] = head + b" " + new + b"\n"
    return b"".join(lines)


def sample_lines(lines: list[bytes]) -> list[int]:
    return [i for i, line in enumerate(lines) if not line.startswith(b"#")]


def edit_name(rng: random.Random, data: bytes) -> bytes:
    lines = lines_of(data)
    i = rng.choice(sample_lines(lines))
    name, rest = lines[i].split(b"{", 1)
    other = rng.choice([
        name + b"_x", name[:-1], b"API_TOKEN", cat.BATCHES.name.encode(),
        cat.TIME.name.encode() + b"_bucket", name.replace(b"_total", b"_created"),
        cat.SHM_SIZE.name.encode()])
    lines[i] = other + b"{" + rest
    return b"".join(lines)


def edit_label(rng: random.Random, data: bytes) -> bytes:
    lines = lines_of(data)
    i = rng.choice(sample_lines(lines))
    old, new = rng.choice([
        (b'rank="1"', b'rank="0"'), (b'rank="1"', b'rank="2"'), (b'loader="t"', b'loader="u"'),
        (b'rank="1"', b'rank="1",extra="x"'), (b'loader=', b'lodaer='), (b'le="', b'le="0'),
        (b'phase="fetch"', b'phase="transfer"'), (b'worker="0"', b'worker="1"'),
        (b'rank="1"', b'rank="\\"\\n\\\\"'), (b'le="+Inf"', b'le="Inf"')])
    lines[i] = lines[i].replace(old, new, 1)
    return b"".join(lines)


def edit_value(rng: random.Random, data: bytes) -> bytes:
    lines = lines_of(data)
    i = rng.choice(sample_lines(lines))
    head = lines[i].rsplit(b" ", 1)[0]
    new = rng.choice([b"1e308", b"1e999", b"-1.0", b"+Inf", b"-Inf", b"NaN", b"0.5",
                      b"123456789.0", b"1_0", b"nan", b"0x10", b"7"])
    lines[i] = head + b" " + new + b"\n"
    return b"".join(lines)


def insert_foreign(rng: random.Random, data: bytes) -> bytes:
    lines = lines_of(data)
    i = rng.randrange(len(lines) + 1)
    foreign = rng.choice([
        b"API_TOKEN=hunter2\n",
        b"# TYPE dataloader_batches_total gauge\ndataloader_batches_total"
        b'{loader="t",rank="0"} 1e9\n',
        b'dataloader_batches_created{loader="t",rank="1"} 1.7e9\n',
        b"# comment\n", b"\n", b'dataloader_batches_total{loader="t",rank="1"} 5 1700000000\n'])
    return b"".join([*lines[:i], foreign, *lines[i:]])


MUTATIONS: list[Callable[[random.Random, bytes], bytes]] = [
    cut_at_byte, cut_at_line, flip_byte, duplicate_line, delete_line, swap_lines, edit_type,
    edit_name, edit_label, edit_value, insert_foreign]
CUTS = (cut_at_byte, cut_at_line)


@pytest.fixture(scope="module")
def snapshots() -> tuple[bytes, bytes]:
    """A healthy trainer's file (loader t, rank 0) and another trainer's (rank 1), to mutate."""
    good = real_snapshot("0", (("t", 0),))
    base = real_snapshot("1", (("t", 2), ("v", 0)))
    return good, base


def test_mutated_snapshots_never_damage_a_good_file_or_the_exposition(
        tmp_path: Path, snapshots: tuple[bytes, bytes]) -> None:
    good_bytes, base = snapshots
    now = time.time()
    good_path = tmp_path / "good.prom"
    good_path.write_bytes(good_bytes)
    os.utime(good_path, (now, now))  # the newest file: its (loader, rank) is its own
    good = series(text_families(good_bytes.decode()))
    collector = TrainerCollector(str(tmp_path), clock=lambda: now)
    registry = CollectorRegistry()
    registry.register(Supervisor([collector]))
    rng = random.Random(20240613)
    accepted = rejected = 0
    counted: str | None = None  # the reason the mutated file was last counted for
    for i in range(300):
        mutate = MUTATIONS[i % len(MUTATIONS)]
        data = mutate(rng, base)
        path = tmp_path / "mutated.prom"
        tmp = tmp_path / "mutated.prom.1.1"
        tmp.write_bytes(data)
        when = int((now - 1) * 1e9) - i * 1000  # older than the good file; a new version
        os.utime(tmp, ns=(when, when))
        os.replace(tmp, path)
        errors_before = collector.errors
        text = exposition.text(registry.collect()).decode()
        om = exposition.openmetrics(registry.collect()).decode()
        trainer = trainer_series(text_families(text))
        assert same_series(trainer, trainer_series(openmetrics_families(om))), (
            mutate.__name__, i)
        mine = {k: v for k, v in trainer.items() if owner(k) == GOOD_OWNER}
        assert same_series(mine, good), (mutate.__name__, i)
        verdict = collector._verdicts[str(path)][1]
        if isinstance(verdict, Snapshot):
            accepted += 1
            counted = None
            assert mutate not in CUTS, "a file cut short was accepted"
            # Taken whole: every series of it that the good file does not own is served.
            theirs = {k: v for k, v in series(text_families(data.decode())).items()
                      if owner(k) != GOOD_OWNER}
            assert same_series(theirs, {k: v for k, v in trainer.items() if k not in good}), (
                mutate.__name__, i)
        else:
            assert isinstance(verdict, Rejected)
            rejected += 1
            assert trainer.keys() == good.keys(), (mutate.__name__, i)
            # Once per file and reason, over two collections and however many versions.
            assert collector.errors == errors_before + (verdict.reason != counted)
            counted = verdict.reason
    assert accepted >= 10 and rejected >= 150, (accepted, rejected)
