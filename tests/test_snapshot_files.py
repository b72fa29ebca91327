"""Snapshot files are untrusted input: what the trainer collector reads and skips, and when
it reads a file again. Which old files it deletes: test_snapshot_retention.py."""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from support.clock import Clock
from support.helpers import parse
from support.real_snapshots import real_snapshot
from support.snapshot_dir import T0, Samples, served, write

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.exporter.collectors import snapshot
from dataloader_exporter.exporter.collectors.snapshot import Rejected
from dataloader_exporter.exporter.collectors.supervisor import Supervisor
from dataloader_exporter.exporter.collectors.trainer import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_SERIES,
    TrainerCollector,
)

SECRET = "API_TOKEN=hunter2"
BATCHES_LINE = b'dataloader_batches_total{loader="t",rank="0"} 4.0\n'


@pytest.fixture(scope="module")
def good() -> bytes:
    """A real snapshot: loader t of rank 0 with 2 workers, 4 batches."""
    return real_snapshot("0", (("t", 2),))


@pytest.fixture(scope="module")
def two_loaders() -> bytes:
    """A real snapshot of rank 1 with loaders t (2 workers) and v (none)."""
    return real_snapshot("1", (("t", 2), ("v", 0)))


def rejected(samples: Samples, reason: str) -> float:
    return samples[(cat.SNAPSHOT_ERRORS.name, (("reason", reason),))]


def intact(samples: Samples, good: bytes) -> bool:
    """Every series of the good file is served with its value, and no other of its loader."""
    mine = parse(good.decode())
    theirs = {k: v for k, v in samples.items() if ("rank", "0") in k[1]}
    return theirs == mine


def promptly(fn: Callable[[], Any], timeout: float = 10.0) -> Any:
    """fn() in a thread; fails (rather than hangs) if it is still blocked at the deadline."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "blocked"
    return result[0]


def reason_of(fn: Callable[[], Any]) -> str:
    with pytest.raises(Rejected) as e:
        fn()
    return e.value.reason


def load_reason(data: bytes) -> str:
    """Why snapshot.load rejects data (fails the test if it accepts them)."""
    return reason_of(lambda: snapshot.load(data, DEFAULT_MAX_SERIES))


def test_a_fifo_named_like_a_snapshot_never_blocks_a_scrape(tmp_path: Path,
                                                             good: bytes) -> None:
    write(tmp_path / "good.prom", good)
    os.mkfifo(tmp_path / "x.prom")
    samples, _ = promptly(lambda: served(TrainerCollector(str(tmp_path))))
    assert intact(samples, good)
    assert rejected(samples, snapshot.NOT_REGULAR) == 1
    # Swapped in between the listing and the open: opened without blocking, then refused.
    reason = promptly(lambda: reason_of(lambda: snapshot.read(str(tmp_path / "x.prom"), 100)))
    assert reason == snapshot.NOT_REGULAR


def test_directories_sockets_and_devices_named_like_snapshots_are_skipped(
        tmp_path: Path, good: bytes) -> None:
    write(tmp_path / "good.prom", good)
    (tmp_path / "dir.prom").mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock.prom"))
    devices = 0
    try:
        os.mknod(tmp_path / "null.prom", stat.S_IFCHR | 0o600, os.makedev(1, 3))
        devices = 1
    except PermissionError:
        pass  # making a device needs root
    try:
        samples, _ = served(TrainerCollector(str(tmp_path)))
    finally:
        sock.close()
    assert intact(samples, good)
    assert rejected(samples, snapshot.NOT_REGULAR) == 2 + devices
    assert samples[(cat.SNAPSHOT_FILES.name, (("state", "fresh"),))] == 1
    assert reason_of(lambda: snapshot.read(str(tmp_path / "dir.prom"), 100)) == (
        snapshot.NOT_REGULAR)


def test_a_symlink_to_a_secret_outside_the_directory_is_neither_read_nor_quoted(
        tmp_path: Path, good: bytes, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    (tmp_path / "secret.env").write_text(SECRET + "\n")
    (metrics / "x.prom").symlink_to(tmp_path / "secret.env")
    write(metrics / "good.prom", good)
    samples, exposed = served(TrainerCollector(str(metrics)))
    assert intact(samples, good)
    assert rejected(samples, snapshot.NOT_REGULAR) == 1
    assert "hunter2" not in exposed
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "hunter2" in m or "API_TOKEN" in m]
    assert [m for m in messages if "'x.prom'" in m and snapshot.NOT_REGULAR in m]
    # Swapped in between the listing and the open: O_NOFOLLOW refuses it.
    assert reason_of(lambda: snapshot.read(str(metrics / "x.prom"), 100)) == (
        snapshot.NOT_REGULAR)


def test_a_symlink_is_not_followed_even_to_a_snapshot_inside_the_directory(
        tmp_path: Path, good: bytes) -> None:
    write(tmp_path / "real.txt", good)
    (tmp_path / "link.prom").symlink_to("real.txt")
    samples, _ = served(TrainerCollector(str(tmp_path)))
    assert T0 not in samples
    assert rejected(samples, snapshot.NOT_REGULAR) == 1


@pytest.mark.parametrize("content", [
    SECRET.encode() + b"\n",
    b"# HELP API_TOKEN_hunter2 x\n# TYPE API_TOKEN_hunter2 gauge\nAPI_TOKEN_hunter2 1\n",
    b"API_TOKEN_hunter2 1\n",
    b"# TYPE dataloader_batches_total hunter2\n",
    b'dataloader_batches_total{loader="API_TOKEN=hunter2\x01",rank="0"} 1\n',
    b"API_TOKEN=hunter2\xff\xfe\n",
    b"# HELP dataloader_info API_TOKEN=hunter2\n",
], ids=["text", "family", "sample", "type", "label", "binary", "help"])
def test_no_part_of_a_rejected_file_reaches_the_logs_or_the_exposition(
        tmp_path: Path, good: bytes, content: bytes, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    write(tmp_path / "good.prom", good)
    write(tmp_path / "bad.prom", content)
    samples, exposed = served(TrainerCollector(str(tmp_path)))
    assert intact(samples, good)
    assert rejected(samples, snapshot.MALFORMED) + rejected(samples, snapshot.INVALID) == 1
    assert "hunter2" not in exposed
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "'bad.prom'" in m]
    assert not [m for m in messages if "hunter2" in m or "API_TOKEN" in m]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_an_unreadable_file_is_skipped_and_counted(tmp_path: Path, good: bytes) -> None:
    write(tmp_path / "good.prom", good)
    write(tmp_path / "locked.prom", good.replace(b'rank="0"', b'rank="3"')).chmod(0)
    samples, _ = served(TrainerCollector(str(tmp_path)))
    assert intact(samples, good)
    assert rejected(samples, snapshot.UNREADABLE) == 1


def test_a_file_cut_at_any_line_boundary_is_rejected_whole(two_loaders: bytes) -> None:
    lines = two_loaders.splitlines(keepends=True)
    for n in range(len(lines)):
        assert load_reason(b"".join(lines[:n])) in (snapshot.MALFORMED, snapshot.INVALID), n
    for n in range(0, len(two_loaders), 7):  # and, sampled, at byte boundaries
        assert load_reason(two_loaders[:n]) in (snapshot.MALFORMED, snapshot.INVALID), n
    assert snapshot.load(two_loaders, DEFAULT_MAX_SERIES).series == len(
        parse(two_loaders.decode()))


def test_a_newer_file_cut_before_its_inf_bucket_leaves_the_good_file_whole(
        tmp_path: Path, good: bytes) -> None:
    write(tmp_path / "good.prom", good, age=5)
    cut = good[:good.index(b'le="+Inf"')].rsplit(b"\n", 1)[0] + b"\n"
    write(tmp_path / "restarted.prom", cut)  # newer, same (loader, rank)
    samples, _ = served(TrainerCollector(str(tmp_path)))
    assert intact(samples, good)
    assert rejected(samples, snapshot.INVALID) == 1


def test_a_foreign_file_declaring_a_catalogue_name_with_another_type_is_rejected(
        tmp_path: Path, good: bytes) -> None:
    write(tmp_path / "good.prom", good, age=5)
    write(tmp_path / "foreign.prom", b"# HELP dataloader_batches_total x\n"
          b"# TYPE dataloader_batches_total gauge\n"
          b'dataloader_batches_total{loader="t",rank="0"} 1e9\n'
          b'dataloader_batches_total{loader="t",rank="9"} 5\n')
    retyped = good.replace(b"# TYPE dataloader_batches_total counter",
                           b"# TYPE dataloader_batches_total gauge")
    write(tmp_path / "retyped.prom", retyped.replace(b'rank="0"', b'rank="8"'))
    samples, _ = served(TrainerCollector(str(tmp_path)))
    assert intact(samples, good)
    assert not [k for k in samples if ("rank", "9") in k[1] or ("rank", "8") in k[1]]
    assert rejected(samples, snapshot.INVALID) == 2


def without(prefix: bytes, count: int = 1) -> Callable[[bytes], bytes]:
    """An edit that drops the first `count` lines starting with prefix."""
    def edit(data: bytes) -> bytes:
        lines, dropped = [], 0
        for line in data.splitlines(keepends=True):
            if dropped < count and line.startswith(prefix):
                dropped += 1
                continue
            lines.append(line)
        assert dropped == count
        return b"".join(lines)
    return edit


def replace(old: bytes, new: bytes, count: int = 1) -> Callable[[bytes], bytes]:
    def edit(data: bytes) -> bytes:
        assert old in data
        return data.replace(old, new, count)
    return edit


def value_of(prefix: bytes, new: bytes) -> Callable[[bytes], bytes]:
    """An edit that sets the value of the first line starting with prefix."""
    def edit(data: bytes) -> bytes:
        at = data.index(prefix)
        end = data.index(b"\n", at)
        head = data[at:end].rsplit(b" ", 1)[0]
        return data[:at] + head + b" " + new + data[end:]
    return edit


TIME = b"dataloader_time_seconds"
FETCH = b'loader="t",phase="fetch",rank="0"}'
EDITS = {
    "unknown family": (replace(b"dataloader_batch_bytes", b"dataloader_batch_octets", -1),
                       "not a trainer metric"),
    "another type": (replace(b"_batches_total counter", b"_batches_total gauge"),
                     "is not a counter"),
    "duplicate series": (replace(BATCHES_LINE, BATCHES_LINE * 2), "twice"),
    "extra label": (replace(b'dataloader_batches_total{loader="t",rank="0"}',
                            b'dataloader_batches_total{loader="t",rank="0",x="1"}'),
                    "label names"),
    "negative counter": (value_of(b"dataloader_batches_total{", b"-1.0"), "counter negative"),
    "NaN counter": (value_of(b"dataloader_batches_total{", b"NaN"), "not finite"),
    "infinite counter": (value_of(b"dataloader_batches_total{", b"+Inf"), "not finite"),
    "no +Inf bucket": (replace(TIME + b'_bucket{le="+Inf",' + FETCH,
                               TIME + b'_bucket{le="100.0",' + FETCH), "buckets differ"),
    "foreign bucket": (replace(TIME + b'_bucket{le="0.001",', TIME + b'_bucket{le="0.002",'),
                       "buckets differ"),
    "+Inf line gone": (without(TIME + b'_bucket{le="+Inf"'), "incomplete"),
    "_sum gone": (without(b"dataloader_step_seconds_sum"), "incomplete"),
    "_count twice": (replace(b"dataloader_step_seconds_sum", b"dataloader_step_seconds_count"),
                     "_sum missing"),
    "count mismatch": (value_of(TIME + b"_count{" + FETCH, b"5.0"), "_count"),
    "not cumulative": (value_of(TIME + b'_bucket{le="0.0001",' + FETCH, b"99.0"),
                       "not cumulative"),
    "fractional bucket": (value_of(TIME + b'_bucket{le="0.0001",' + FETCH, b"0.5"),
                          "whole numbers"),
    "negative sum": (value_of(b"dataloader_step_seconds_sum", b"-1.0"), "_sum"),
    "one phase": (replace(b'phase="transfer"', b'phase="xfer"', -1), "a phase other"),
    "phantom loader": (replace(BATCHES_LINE, BATCHES_LINE.replace(b'"0"', b'"7"')),
                       "without all of its"),
    "worker missing": (without(b'dataloader_worker_cpu_seconds_total{loader="t",rank="0",'
                               b'worker="1"}'), "different workers"),
    "info missing": (without(b"dataloader_info{"), "dataloader_info"),
    "created sample": (replace(BATCHES_LINE, BATCHES_LINE + BATCHES_LINE.replace(
        b"_total", b"_created")), "sample outside its family"),
    "timestamp": (replace(BATCHES_LINE, BATCHES_LINE.replace(b" 4.0", b" 4.0 17000000")),
                  "not the text exposition format"),
    # More than the catalogue's families and its retired ones could need.
    "comment": (replace(BATCHES_LINE, BATCHES_LINE + b"# a comment\n" * 3), "comment lines"),
    "blank line": (replace(BATCHES_LINE, BATCHES_LINE + b"\n"), "not the text exposition"),
    "more families": (lambda g: g + b"# HELP x y\n# TYPE x gauge\n" * 20, "comment lines"),
}


@pytest.mark.parametrize("case", EDITS)
def test_a_file_that_is_not_exactly_what_the_writer_writes_is_rejected(good: bytes,
                                                                      case: str) -> None:
    edit, detail = EDITS[case]
    with pytest.raises(Rejected) as e:
        snapshot.load(edit(good), DEFAULT_MAX_SERIES)
    assert detail in e.value.detail
    assert e.value.reason in (snapshot.INVALID, snapshot.MALFORMED)


@pytest.mark.parametrize("data", [
    b"x " + b"1" * 1_000_000 + b"y\n",
    b"x " + b"1" * 500_000 + b"." + b"1" * 500_000 + b"e\n",
    b"x{" + b"}" * 1_000_000 + b" 1y\n",
    b"x{" + b"} 1" * 300_000 + b"y\n",
    b"a" * 1_000_000 + b"\n",
    b'x{a="' + b"\\\\" * 500_000 + b"} 1\n",
    b"# HELP x y\n# TYPE x gauge\n" * 50_000,
], ids=["digits", "decimal", "braces", "brace-numbers", "name", "escapes", "families"])
def test_a_long_line_or_file_that_is_not_the_format_is_rejected_without_backtracking(
        data: bytes) -> None:
    # The deadline is for a hang: a backtracking pattern took 5 s on 16,000 digits.
    assert promptly(lambda: load_reason(data), timeout=30) in (
        snapshot.MALFORMED, snapshot.INVALID)


def test_real_snapshots_of_every_shape_are_accepted(good: bytes, two_loaders: bytes) -> None:
    shapes = [good, two_loaders, real_snapshot("2", (("a", 0), ("b", 1)), to_device_first="b"),
              real_snapshot("3", ())]
    for data in shapes:
        assert snapshot.load(data, DEFAULT_MAX_SERIES).series == len(parse(data.decode()))


def relayout_transfer(data: bytes, bounds: tuple[float, ...]) -> bytes:
    """The snapshot with its transfer histograms' buckets in another layout, each bucket
    holding every observation (cumulative, and equal to _count)."""
    out: list[bytes] = []
    for line in data.splitlines(keepends=True):
        if not (line.startswith(cat.TIME.name.encode() + b"_bucket{")
                and b'phase="transfer"' in line):
            out.append(line)
        elif b'le="+Inf"' in line:  # the last bucket: write the whole layout in its place
            out += [line.replace(b'le="+Inf"', f'le="{b!r}"'.encode()) for b in bounds]
            out.append(line)
    return b"".join(out)


def test_transfer_histograms_in_the_fetch_layout_of_older_writers_are_accepted(
        two_loaders: bytes) -> None:
    transfer = b'phase="transfer"'
    assert transfer in two_loaders
    older = relayout_transfer(two_loaders, cat.PHASE_BUCKETS[cat.PHASE_FETCH])
    assert older.count(transfer) > two_loaders.count(transfer)
    assert snapshot.load(older, DEFAULT_MAX_SERIES).series == len(parse(older.decode()))
    # Any other layout is not what a writer wrote.
    with pytest.raises(Rejected, match=cat.TIME.name):
        snapshot.load(relayout_transfer(two_loaders, (0.0005, 0.005)), DEFAULT_MAX_SERIES)


OLDER = Path(__file__).resolve().parent / "trainer_snapshots" / "older" / "rank0-t2-4batches.prom"
HEARTBEAT = cat.RETIRED[0].name


def test_an_older_trainers_snapshot_is_served_without_its_retired_families(
        tmp_path: Path) -> None:
    """A real snapshot of an older trainer (loader t, 2 workers): a per-worker heartbeat
    and the step's former 9-bound layout, still accepted beside newer trainers' files."""
    older = OLDER.read_bytes()
    kept = {k: v for k, v in parse(older.decode()).items() if k[0] != HEARTBEAT}
    assert len(kept) == len(parse(older.decode())) - 2  # its two workers' heartbeats
    assert snapshot.load(older, DEFAULT_MAX_SERIES).series == len(kept)
    write(tmp_path / "older.prom", older)
    samples, text = served(TrainerCollector(str(tmp_path)))
    assert HEARTBEAT not in text
    assert {k: v for k, v in samples.items() if ("rank", "0") in k[1]} == kept
    step_les = {dict(k[1])["le"] for k in kept if k[0] == cat.STEP.name + "_bucket"}
    assert step_les == {repr(b) for b in cat.STEP_BINS} | {"+Inf"}


def test_an_older_trainers_heartbeats_must_name_the_workers_with_cpu_time() -> None:
    older = OLDER.read_bytes()
    cut = without(HEARTBEAT.encode() + b'{loader="t",rank="0",worker="1"}')(older)
    with pytest.raises(Rejected, match="different workers"):
        snapshot.load(cut, DEFAULT_MAX_SERIES)
    with pytest.raises(Rejected, match="different workers"):  # cpu time without a heartbeat
        snapshot.load(without(b'dataloader_worker_cpu_seconds_total{loader="t",rank="0",'
                              b'worker="1"}')(older), DEFAULT_MAX_SERIES)


def family_dropped(data: bytes, metric: cat.Metric) -> bytes:
    """The snapshot without one family: its HELP, TYPE and sample lines."""
    name = metric.name.encode()
    return b"".join(line for line in data.splitlines(keepends=True)
                    if not line.startswith((b"# HELP " + name + b" ", b"# TYPE " + name + b" ",
                                            name + b"{", name + b" ")))


def test_only_the_families_added_since_an_older_writer_may_be_missing(
        two_loaders: bytes) -> None:
    for metric in cat.ADDED:
        older = family_dropped(two_loaders, metric)
        assert len(older) < len(two_loaders)
        assert snapshot.load(older, DEFAULT_MAX_SERIES).owners.keys() == {("t", "1"),
                                                                          ("v", "1")}
    with pytest.raises(Rejected, match="1 trainer families missing"):
        snapshot.load(family_dropped(two_loaders, cat.BATCH_BYTES), DEFAULT_MAX_SERIES)


def test_a_step_histogram_in_neither_its_layout_nor_its_former_one_is_rejected(
        good: bytes) -> None:
    line = b'dataloader_step_seconds_bucket{le="0.1",loader="t",rank="0"}'
    assert line in good
    with pytest.raises(Rejected, match=cat.STEP.name):
        snapshot.load(without(line)(good), DEFAULT_MAX_SERIES)


OLDER_EXITED = OLDER.with_name("rank0-t2-4batches-exited.prom")
EXIT_TYPE = f"# TYPE {cat.EXITED.name} gauge\n".encode()


def with_exits(data: bytes, *labels: str, value: float = 1.7e9) -> bytes:
    """The snapshot with exit time series of these label texts (each `value` more than
    the last) under their TYPE line."""
    lines = "".join(f"{cat.EXITED.name}{{{text}}} {value + i!r}\n" for i, text in
                    enumerate(labels))
    return data.replace(EXIT_TYPE, EXIT_TYPE + lines.encode())


def exit_times(samples: Samples) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (name, labels), v in samples.items() if name == cat.EXITED.name}


def test_the_exit_time_is_the_processs_one_series_per_rank(tmp_path: Path) -> None:
    exited = real_snapshot("0", (("t", 2),), exited=True)
    line = next(x for x in exited.splitlines() if x.startswith(cat.EXITED.name.encode()))
    assert line.startswith(cat.EXITED.name.encode() + b'{rank="0"} ')
    loaded = snapshot.load(exited, DEFAULT_MAX_SERIES)
    assert loaded.series == len(parse(exited.decode()))
    assert set(loaded.owners) == {("t", "0")}
    assert loaded.ranks == {"0": {cat.EXITED.name: line.decode() + "\n"}}
    write(tmp_path / "exited.prom", exited)
    samples, _ = served(TrainerCollector(str(tmp_path)))
    assert exit_times(samples) == {(("rank", "0"),): float(line.split()[-1])}


def test_an_older_trainers_exit_time_per_loader_is_served_once_per_rank(
        tmp_path: Path, two_loaders: bytes) -> None:
    """A real snapshot of a writer that wrote the exit time per loader: accepted, and
    served as the rank's; with two loaders, once, the latest."""
    older = OLDER_EXITED.read_bytes()
    assert cat.EXITED.name.encode() + b'{loader="t",rank="0"} ' in older
    (when,) = exit_times(parse(older.decode())).values()
    write(tmp_path / "older.prom", older)
    samples, _ = served(TrainerCollector(str(tmp_path)))
    assert exit_times(samples) == {(("rank", "0"),): when}
    assert {k: v for k, v in samples.items() if ("rank", "0") in k[1]} == {
        k: v for k, v in parse(older.decode()).items() if k[0] != cat.EXITED.name} | {
        (cat.EXITED.name, (("rank", "0"),)): when}
    both = with_exits(two_loaders, 'loader="t",rank="1"', 'loader="v",rank="1"')
    loaded = snapshot.load(both, DEFAULT_MAX_SERIES)
    assert loaded.series == len(parse(two_loaders.decode())) + 1
    write(tmp_path / "older.prom", both)
    samples, _ = served(TrainerCollector(str(tmp_path)))
    assert exit_times(samples) == {(("rank", "1"),): 1.7e9 + 1}


@pytest.mark.parametrize("labels", [
    ('rank="7"',),  # a rank none of the file's loaders has
    ('loader="t",rank="1",worker="0"',),  # neither its label names nor its former ones
    ("",),
    ('rank="1"', 'rank="1"'),  # twice
    ('loader="t",rank="1"', 'loader="t",rank="1"'),
])
def test_an_exit_time_other_than_the_writers_is_rejected(two_loaders: bytes,
                                                          labels: tuple[str, ...]) -> None:
    assert snapshot.load(with_exits(two_loaders, 'rank="1"'), DEFAULT_MAX_SERIES).ranks
    data = with_exits(two_loaders, *labels).replace(b"{}", b"")
    with pytest.raises(Rejected, match=r"rank without a loader|label names") as e:
        snapshot.load(data, DEFAULT_MAX_SERIES)
    assert e.value.reason == snapshot.INVALID


def test_a_newer_file_of_the_same_rank_drops_an_older_ones_exit_time(
        tmp_path: Path, good: bytes) -> None:
    """A restarted trainer: its running file, not its predecessor's exit, is the rank's."""
    exited = real_snapshot("0", (("t", 2),), exited=True)
    write(tmp_path / "before.prom", exited, age=5)
    write(tmp_path / "now.prom", good)
    samples, _ = served(TrainerCollector(str(tmp_path)))
    assert not exit_times(samples) and samples[T0] == 4
    write(tmp_path / "now.prom", good, age=10)  # the exited one is the newer
    samples, _ = served(TrainerCollector(str(tmp_path)))
    assert list(exit_times(samples)) == [(("rank", "0"),)]


def test_files_over_the_size_bound_are_skipped_and_never_read_whole(
        tmp_path: Path, good: bytes) -> None:
    write(tmp_path / "good.prom", good)
    with open(tmp_path / "huge.prom", "wb") as f:
        f.truncate(1 << 30)  # 1 GiB, sparse
    samples, _ = served(TrainerCollector(str(tmp_path)))
    assert intact(samples, good)
    assert rejected(samples, snapshot.TOO_LARGE) == 1
    (tmp_path / "huge.prom").unlink()
    exact = TrainerCollector(str(tmp_path), max_file_bytes=len(good))
    assert served(exact)[0][T0] == 4
    under = TrainerCollector(str(tmp_path), max_file_bytes=len(good) - 1)
    samples, _ = served(under)
    assert T0 not in samples and rejected(samples, snapshot.TOO_LARGE) == 1
    assert 20 * len(good) <= DEFAULT_MAX_FILE_BYTES
    if Path("/proc/self/status").exists():  # its stat says 0 bytes: the read is bounded
        assert reason_of(lambda: snapshot.read("/proc/self/status", 16)) == snapshot.TOO_LARGE


def test_files_with_more_series_than_the_bound_are_skipped(tmp_path: Path,
                                                           good: bytes) -> None:
    write(tmp_path / "good.prom", good)
    count = len(parse(good.decode()))
    assert served(TrainerCollector(str(tmp_path), max_series=count))[0][T0] == 4
    samples, _ = served(TrainerCollector(str(tmp_path), max_series=count - 1))
    assert T0 not in samples and rejected(samples, snapshot.TOO_MANY_SERIES) == 1
    assert 20 * count <= DEFAULT_MAX_SERIES


def test_a_bad_file_is_counted_and_logged_once_per_reason_however_often_it_is_rewritten(
        tmp_path: Path, good: bytes, caplog: pytest.LogCaptureFixture, clock: Clock) -> None:
    write(tmp_path / "good.prom", good)
    bad = write(tmp_path / "bad.prom", b"garbage\n")
    write(tmp_path / "worse.prom", b"# TYPE x counter\n")
    collector = TrainerCollector(str(tmp_path), clock=clock)
    registry = CollectorRegistry()
    registry.register(Supervisor([collector]))

    def errors() -> tuple[float | None, float | None, float | None]:
        return (registry.get_sample_value(cat.SNAPSHOT_ERRORS.name, {"reason": "malformed"}),
                registry.get_sample_value(cat.COLLECTOR_ERRORS.name, {"collector": "trainer"}),
                registry.get_sample_value(cat.BATCHES.name, {"loader": "t", "rank": "0"}))

    for _ in range(10):
        assert errors() == (2, 2, 4)
    clock.now += 2
    write(bad, b"garbage, rewritten\n")  # a new version, still bad for the same reason
    for _ in range(10):
        assert errors() == (2, 2, 4)
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(logged) == 2  # one per file
    assert any("'bad.prom'" in m for m in logged) and any("'worse.prom'" in m for m in logged)
    write(bad, good.replace(b'rank="0"', b'rank="5"'))  # fixed ...
    assert errors() == (2, 2, 4)
    write(bad, b"garbage once more\n")  # ... and broken again: counted and logged again
    assert errors() == (3, 3, 4)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 3


def rewrite_in_place(path: Path, data: bytes) -> None:
    """New content under the same stamp: same inode, size and modification time."""
    st = path.stat()
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_an_unchanged_file_is_neither_read_nor_parsed_again(tmp_path: Path,
                                                            good: bytes) -> None:
    path = write(tmp_path / "a.prom", good)
    collector = TrainerCollector(str(tmp_path))
    assert served(collector)[0][T0] == 4
    rewrite_in_place(path, good.replace(BATCHES_LINE, BATCHES_LINE.replace(b"4.0", b"5.0")))
    assert served(collector)[0][T0] == 4  # the verdict on this (inode, mtime, size)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1))
    assert served(collector)[0][T0] == 5
    # A bad file likewise: its verdict stands (and is not counted again) until it changes.
    rewrite_in_place(path, good.replace(BATCHES_LINE, BATCHES_LINE.replace(b"4.0", b"x.0")))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1))
    samples, _ = served(collector)
    assert T0 not in samples and rejected(samples, snapshot.MALFORMED) == 1
    rewrite_in_place(path, good)
    samples, _ = served(collector)
    assert T0 not in samples and rejected(samples, snapshot.MALFORMED) == 1
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1))
    assert served(collector)[0][T0] == 4


def test_bucket_labels_parse_the_same_through_the_le_first_path_and_the_general_one() -> None:
    from dataloader_exporter.exporter.collectors import textparse

    canonical = 'le="0.25",loader="a\\"b",phase="fetch",rank="3"'
    moved = 'loader="a\\"b",phase="fetch",rank="3",le="0.25"'  # valid, but le not first
    head = "# HELP x_seconds X.\n# TYPE x_seconds histogram\n"
    fast = textparse.parse(f"{head}x_seconds_bucket{{{canonical}}} 1.0\n")[0].samples[0][1]
    slow = textparse.parse(f"{head}x_seconds_bucket{{{moved}}} 1.0\n")[0].samples[0][1]
    # All but mapping, which for a bucket line on the fast path leaves le out (shared).
    assert fast._replace(mapping={}) == slow._replace(mapping={})
    assert fast.text == "{" + canonical + "}" and fast.mapping == dict(slow.rest)
    assert (fast.le, fast.rest, fast.names[0]) == ("0.25", slow.rest, "le")
    for bad in ('le="0.25",', 'le="0.25",loader=x', 'le="0.25"loader="a"', 'le="1",a="b"x'):
        with pytest.raises(ValueError):
            textparse.parse(f"{head}x_seconds_bucket{{{bad}}} 1.0\n")
