"""The doctor and top name the workers' memory growth, its cause (copy-on-read of a large
container of Python objects among the dataset's attributes) and how long the room lasts;
growth under the threshold, or not measured, says nothing. Windows are built from
exposition text as the trainer writes it (test_doctor_why's), read twice 10 s apart; the
same figures are read from a snapshot directory and through Prometheus's HTTP API."""

from __future__ import annotations

import json
import re
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from support.real_snapshots import real_snapshot
from test_doctor_dir import read_dir, written_ago
from test_doctor_why import MACHINE, SECONDS, exposition, kinds, sample, setting

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.diagnosis import memgrowth, promsource, top, why
from dataloader_exporter.diagnosis.doctor import Diagnosis
from dataloader_exporter.diagnosis.report import Report, build_report
from dataloader_exporter.diagnosis.signals import Scrape, Window, loaders

GiB, MiB = 1 << 30, 1 << 20
PER_MINUTE = MiB / 60  # bytes/s: 1 MiB a minute
# (attribute, container, item, objects label, bytes)
Container = tuple[str, str, str, int | str | None, float]
PATHS: Container = ("dataset.paths", "list", "str", 3_000_000, 3.2e8)
# 8 blocked workers, 300 MiB each (PSS).
EIGHT: dict[str, Any] = {"workers": 8, "states": (8.0, 0.0, 72.0), "pss": 8 * 300 * MiB}


def memory(*, growth: float | None = None, room: float | None = None,
           containers: tuple[Container, ...] = ()) -> str:
    """The copy-on-read series as the trainer exports them: the growth summed over the
    live workers, the least the trainer's container could still allocate (kind=available)
    and the dataset's largest container (its item count a label: None leaves it out; the
    trainer exports one, more only stand for a range in which it changed)."""
    lines = []
    if room is not None:
        lines.append(sample(cat.WORKER_MEMORY, room, kind="available"))
    if growth is not None:
        lines.append(sample(cat.WORKER_PRIVATE_GROWTH, growth))
    for attribute, container, item, n, size in containers:
        labels = {"attribute": attribute, "container": container, "item": item,
                  **({} if n is None else {"objects": str(n)})}
        lines.append(sample(cat.DATASET_OBJECTS, size, **labels))
    return "".join(line + "\n" for line in lines)


def texts(figures: dict[str, Any], mem: dict[str, Any]) -> tuple[str, str]:
    return (exposition(0, **figures) + memory(**mem), exposition(1, **figures) + memory(**mem))


def report(figures: dict[str, Any], **mem: Any) -> Report:
    first, second = texts(figures, mem)
    window = Window.between(Scrape.parse(first, at=1000.0),
                            Scrape.parse(second, at=1000.0 + SECONDS))
    return build_report("test", MACHINE, loaders(window), 1)


def diagnosis(figures: dict[str, Any], **mem: Any) -> Diagnosis:
    [d] = report(figures, **mem).diagnoses
    return d


def growth_of(d: Diagnosis) -> str | None:
    found = [f.message for f in d.findings if f.kind == memgrowth.KIND]
    assert len(found) <= 1
    return found[0] if found else None


# --- the finding ----------------------------------------------------------------------------
def test_a_list_of_str_the_workers_copy_is_named_with_its_fix_and_the_time_left() -> None:
    # 8 workers grow 5 MiB a minute each: 40 MiB a minute fill the 2 GiB the trainer's
    # container has left in 51 min. Copy-on-read alone could take 8 x 3.2e8 bytes, more
    # than the room: no "stops sooner".
    d = diagnosis(EIGHT, growth=8 * 5 * PER_MINUTE, room=2 * GiB, containers=(PATHS,))
    assert growth_of(d) == (
        "memory growth: the workers' private memory grows ~5.0 MiB a minute each (8 workers; "
        "copy-on-read): `dataset.paths` is a list of 3,000,000 str (~0.30 GiB) whose items' "
        "reference counts are written on every read, so each worker copies their pages, and "
        "each added worker would copy them too; store it as a numpy array (`np.array([x.encode"
        "() for x in paths])`, decoded when read), a pyarrow array or a tensor; at this rate "
        "the workers use up the 2.00 GiB the trainer's container has left (its least while "
        "the workers ran) in about 51 min")
    assert d.figures["workers_memory_left_seconds"] == pytest.approx(2 * GiB / (40 * PER_MINUTE))
    assert not d.healthy


def test_a_copy_that_fits_in_the_room_says_when_copy_on_read_alone_would_stop() -> None:
    d = diagnosis(EIGHT, growth=8 * 5 * PER_MINUTE, room=16 * GiB, containers=(PATHS,))
    message = growth_of(d)
    assert message is not None
    assert "use up the 16.00 GiB the trainer's container has left" in message
    assert ("in about 6.8 h; if copy-on-read is all that grows, it stops sooner: each worker "
            "copies about the container's 0.30 GiB once, 2.38 GiB for the 8") in message


def test_the_item_count_is_read_from_the_objects_label_and_a_bad_one_is_left_out() -> None:
    for label in (None, "", "3e6", "-3", "3.5", "many"):
        d = diagnosis(EIGHT, growth=8 * 5 * PER_MINUTE,
                      containers=(("dataset.paths", "list", "str", label, 3.2e8),))
        [c] = d.workers.dataset_containers
        assert (c.objects, c.bytes) == (None, 3.2e8), label
        message = growth_of(d)
        assert message is not None and "`dataset.paths` is a list of str (~0.30 GiB)" in message
    [c] = diagnosis(EIGHT, containers=(PATHS,)).workers.dataset_containers
    assert (c.attribute, c.container, c.item, c.objects, c.bytes) == PATHS


def test_growth_without_a_large_container_is_named_but_not_called_copy_on_read() -> None:
    d = diagnosis({**EIGHT, "cgroup": (16 * GiB, 12 * GiB)}, growth=8 * 3 * PER_MINUTE)
    message = growth_of(d)
    assert message is not None
    assert message.startswith("memory growth: the workers' private memory grows ~3.0 MiB a "
                              "minute each (8 workers), and the trainer named no large "
                              "container of Python objects among the dataset's attributes")
    assert "a cache the dataset fills, a leak" in message
    assert "copy-on-read" not in message and "np.array" not in message
    # The container's limit less its usage: 4 GiB at 24 MiB a minute.
    assert "use up the 4.00 GiB left under the container's memory limit in about 2.8 h" in message


def test_a_container_whose_workers_do_not_grow_is_no_finding() -> None:
    plain = diagnosis(EIGHT, room=2 * GiB)
    for growth in (None, 0.0):
        d = diagnosis(EIGHT, growth=growth, room=2 * GiB, containers=(PATHS,))
        assert growth_of(d) is None and kinds(d) == kinds(plain)
        assert d.recommendations == plain.recommendations  # nothing drawn from it
        assert d.workers.dataset_containers[0].attribute == "dataset.paths"  # still read
    assert growth_of(diagnosis(EIGHT, growth=8 * PER_MINUTE, containers=(PATHS,))) is not None


def test_growth_under_the_threshold_is_no_finding_and_at_it_is_one() -> None:
    under = diagnosis(EIGHT, growth=8 * 0.9 * PER_MINUTE, containers=(PATHS,))
    assert growth_of(under) is None
    assert under.workers.private_growth_bytes_per_second == pytest.approx(0.9 * PER_MINUTE)
    assert memgrowth.GROWTH_PER_WORKER == PER_MINUTE
    assert growth_of(diagnosis(EIGHT, growth=8 * PER_MINUTE, containers=(PATHS,))) is not None


def test_absent_growth_gives_no_finding_no_figure_and_no_advice_drawn_from_it() -> None:
    plain = diagnosis(EIGHT, room=2 * GiB)
    d = diagnosis(EIGHT, room=2 * GiB, containers=(PATHS,))
    assert growth_of(d) is None and kinds(d) == kinds(plain)
    assert d.recommendations == plain.recommendations and d.unknowns == plain.unknowns
    for name in ("worker_private_growth_bytes_per_second", "workers_memory_left_seconds"):
        assert d.figures[name] is None
    assert d.workers.private_growth_bytes_per_second is None
    assert d.workers.copy_left_bytes is None


def test_growth_holds_back_more_workers_and_keeps_the_queue() -> None:
    # Two blocked workers would get the model's 15; growing, they get no more.
    figures: dict[str, Any] = {"workers": 2, "states": (2.0, 0.0, 18.0), "pss": 2 * 300 * MiB}
    assert setting(diagnosis(figures), "num_workers").value == "15"
    d = diagnosis(figures, growth=2 * 5 * PER_MINUTE, containers=(PATHS,))
    assert memgrowth.KIND in kinds(d) and setting(d, "num_workers") is None
    assert setting(d, "prefetch_factor").value == "4"  # not halved: batches do not grow


# A 5,000,000-path list of 500 MiB: more than the 300 MiB each worker holds (PSS).
BIG: Container = ("dataset.paths", "list", "str", 5_000_000, 500.0 * MiB)
TWO: dict[str, Any] = {"workers": 2, "states": (2.0, 0.0, 18.0), "pss": 2 * 300 * MiB}


def test_the_memory_cap_counts_what_each_worker_is_still_to_copy_only_while_it_grows() -> None:
    # Room: 7 GiB less 10% of 64 GiB = 0.6 GiB. At 300 MiB a worker, 2 more fit; each is
    # still to copy 500 MiB less its 300 MiB (PSS, all counted as copied), which the 2 live
    # ones take from the room too: (614 - 2 x 200) / (300 + 200) is none.
    mem: dict[str, Any] = {"room": 7 * GiB, "containers": (BIG,)}
    flat = diagnosis(TWO, **mem)
    assert flat.workers.more_workers_memory_allows == 2 and flat.workers.copy_left_bytes is None
    grows = diagnosis(TWO, growth=2 * 5 * PER_MINUTE, **mem)
    assert grows.workers.copy_left_bytes == pytest.approx(200 * MiB)
    assert grows.workers.more_workers_memory_allows == 0
    assert grows.workers.bottleneck == why.MEMORY
    assert ("each worker holds 0.29 GiB (PSS) and is still to copy about 0.20 GiB of "
            "`dataset.paths` (copy-on-read); 0.60 GiB available allows 0 more"
            ) in grows.workers.why


def test_without_pss_a_worker_is_counted_as_having_copied_nothing() -> None:
    # RSS counts the pages shared with the parent in every worker: nothing is taken from
    # the container's size for it. (614 - 2 x 500) leaves no room for one more.
    figures = {**{k: v for k, v in TWO.items() if k != "pss"}, "rss": 2 * 300 * MiB}
    d = diagnosis(figures, growth=2 * 5 * PER_MINUTE, room=7 * GiB, containers=(BIG,))
    assert d.workers.memory_kind == "rss"
    assert d.workers.copy_left_bytes == pytest.approx(500 * MiB)
    assert d.workers.more_workers_memory_allows == 0
    assert "is still to copy about 0.49 GiB of `dataset.paths`" in d.workers.why


def test_without_live_workers_the_growth_is_over_the_configured_ones_and_not_projected() -> None:
    figures = dict(EIGHT)
    mem: dict[str, Any] = {"growth": 8 * 2 * PER_MINUTE, "room": 2 * GiB, "containers": (PATHS,)}
    first, second = texts(figures, mem)
    alive = f"{cat.WORKERS_ACTIVE.name}{{loader=\"train\",rank=\"0\"}} 8\n"
    assert alive in second
    none = alive.replace(" 8", " 0")
    window = Window.between(Scrape.parse(first.replace(alive, none), at=1000.0),
                            Scrape.parse(second.replace(alive, none), at=1000.0 + SECONDS))
    [d] = build_report("test", MACHINE, loaders(window), 1).diagnoses
    message = growth_of(d)
    assert message is not None
    assert "grows ~2.0 MiB a minute each (8 workers configured, none alive now;" in message
    assert "use up" not in message and d.figures["workers_memory_left_seconds"] is None


def test_the_json_carries_the_growth_and_the_container() -> None:
    r = report(EIGHT, growth=8 * 5 * PER_MINUTE, room=2 * GiB, containers=(PATHS,))
    [loader] = json.loads(json.dumps(r.as_dict()))["loaders"]
    figures, workers = loader["figures"], loader["workers"]
    assert figures["worker_private_growth_bytes_per_second"] == pytest.approx(40 * PER_MINUTE)
    assert figures["workers_memory_left_seconds"] == pytest.approx(3072.0)
    assert workers["private_growth_bytes_per_second"] == pytest.approx(5 * PER_MINUTE)
    assert workers["dataset_containers"] == [
        {"attribute": "dataset.paths", "container": "list", "item": "str",
         "objects": 3_000_000, "bytes": 3.2e8}]
    assert [f["kind"] for f in loader["findings"]].count(memgrowth.KIND) == 1


# --- an OOM kill --------------------------------------------------------------------------
def test_an_oom_kill_names_the_growth_and_the_attribute_and_puts_the_array_first() -> None:
    d = diagnosis({**EIGHT, "failures": {"oom": 1}}, growth=8 * 5 * PER_MINUTE,
                  containers=(PATHS,))
    [entry] = d.failures
    seen, fix = str(entry["seen"]), str(entry["fix"])
    assert seen.endswith(
        "; the workers' private memory grew ~5.0 MiB a minute each; copy-on-read: "
        "`dataset.paths`, a list of 3,000,000 str (~0.30 GiB), which every worker copies as "
        "it reads its items (their reference counts are written on every read)")
    assert fix.startswith("store `dataset.paths` as a numpy array (`np.array(")
    assert "; then fewer workers (num_workers=8 now)" in fix
    assert entry["worker_private_growth_bytes_per_second"] == pytest.approx(40 * PER_MINUTE)
    assert entry["dataset_containers"] == [
        {"attribute": "dataset.paths", "container": "list", "item": "str",
         "objects": 3_000_000, "bytes": 3.2e8}]
    [finding] = [f.message for f in d.findings if f.kind == "failure-oom"]
    assert "`dataset.paths`" in finding and "Fix: store `dataset.paths`" in finding


def test_an_oom_kill_with_a_container_but_no_growth_names_it_as_what_the_dataset_holds() -> None:
    for growth in (None, 0.0, 8 * 0.9 * PER_MINUTE):
        d = diagnosis({**EIGHT, "failures": {"oom": 1}}, growth=growth, containers=(PATHS,))
        [entry] = d.failures
        seen, fix = str(entry["seen"]), str(entry["fix"])
        assert seen.endswith(
            "; the dataset holds `dataset.paths`, a list of 3,000,000 str (~0.30 GiB), which "
            "each worker that reads its items copies, about its size each (copy-on-read: their "
            "reference counts are written on every read); whether they did is not known "
            "(their private memory was not seen to grow)"), growth
        assert "grew" not in seen
        assert fix.startswith("if the workers read it, store `dataset.paths` as a numpy array")
        assert "datasets that share memory across workers" not in fix


def test_an_oom_kill_with_growth_but_no_container_says_something_else_accumulates() -> None:
    d = diagnosis({**EIGHT, "failures": {"oom": 1}}, growth=8 * 5 * PER_MINUTE)
    [entry] = d.failures
    assert "something else may accumulate in the workers" in str(entry["seen"])
    assert str(entry["fix"]).startswith("find what accumulates in the workers")
    assert "copy-on-read" not in str(entry["seen"])


def test_an_oom_kill_without_growth_or_container_reads_as_before() -> None:
    [entry] = diagnosis({**EIGHT, "failures": {"oom": 1}}, growth=0.0).failures
    assert "private memory" not in str(entry["seen"])
    assert str(entry["fix"]).startswith("fewer workers")
    assert "datasets that share memory across workers" in str(entry["fix"])


# --- top ----------------------------------------------------------------------------------
def test_top_shows_the_growth_per_worker_and_the_attribute_under_the_row() -> None:
    first, second = texts(EIGHT, {"growth": 8 * 5 * PER_MINUTE, "containers": (PATHS,)})
    signals = loaders(Window.between(Scrape.parse(first, at=0.0), Scrape.parse(second, at=10.0)))
    frame = top.render(signals, "test")
    [row] = [line for line in frame if line.startswith("train")]
    assert row == top.row(signals[0]) and frame[frame.index(row) + 1] == (
        "  train rank 0: workers' private memory grows 5.0 MiB a minute each (copy-on-read: "
        "`dataset.paths`, a list of 3,000,000 str (~0.30 GiB))")
    flat = texts(EIGHT, {"growth": 8 * 0.5 * PER_MINUTE, "containers": (PATHS,)})
    calm = loaders(Window.between(Scrape.parse(flat[0], at=0.0), Scrape.parse(flat[1], at=10.0)))
    assert len(top.render(calm, "test")) == 4  # title, status, header, the row


# --- the sources: a snapshot directory and Prometheus ---------------------------------------
def with_growth(text: str, loader: str, growth: float) -> str:
    """A real snapshot file's text with the copy-on-read families added, as a trainer
    that has them writes them (an older writer's file lacks them: cat.ADDED)."""
    attribute, container, item, n, size = PATHS
    c = f'attribute="{attribute}",container="{container}",item="{item}"'
    lr = f'loader="{loader}"'
    for m, body in [(cat.WORKER_PRIVATE_GROWTH, f'{{{lr},rank="0"}} {growth!r}'),
                    (cat.DATASET_OBJECTS, f'{{{c},{lr},objects="{n}",rank="0"}} {size!r}')]:
        typed = f"# TYPE {m.name} gauge\n"
        assert typed in text, f"the real file lacks {m.name}: rewrite tests/trainer_snapshots"
        text = text.replace(typed, f"{typed}{m.name}{body}\n")
    return text


def test_a_snapshot_directory_carries_the_growth_and_the_container(tmp_path: Path) -> None:
    # A real trainer's file (loader t, 2 workers, exited: none alive): its growth kept.
    real = real_snapshot("0", (("t", 2),), 4, None, True).decode()
    (tmp_path / "host-1-abcd.prom").write_text(with_growth(real, "t", 2 * 6 * PER_MINUTE))
    written_ago(tmp_path, 60)
    r = read_dir(tmp_path)
    [d] = r.diagnoses
    assert d.workers.private_growth_bytes_per_second == pytest.approx(6 * PER_MINUTE)
    assert [(c.attribute, c.container, c.item, c.objects, c.bytes)
            for c in d.workers.dataset_containers] == [PATHS]
    message = growth_of(d)
    assert message is not None and "(2 workers configured, none alive now; copy-on-read)" in (
        message)
    assert "use up" not in message  # the run has ended: nothing is left to fill


class FakePrometheus(BaseHTTPRequestHandler):
    """Prometheus's /api/v1/query over fixed samples, for the expressions promsource
    builds: an aggregation by labels of increase, delta or last_over_time over a range,
    and a plain range selector. The matchers are not applied (the test selects all)."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], list[tuple[float, float]]] = {}
    AGG = re.compile(r"^(sum|max|count)(?: by \(([^)]*)\))? ?\((increase|delta|last_over_time)"
                     r"\((\w+)\{[^}]*\}\[\d+s\]\)\)$")
    RANGE = re.compile(r"^(\w+)\{[^}]*\}\[\d+s\]$")

    def do_GET(self) -> None:
        expr = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)["query"][0]
        body = json.dumps({"status": "success", "data": {"result": self.result(expr)}})
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def result(self, expr: str) -> list[dict[str, Any]]:
        if m := self.RANGE.match(expr):
            return [{"metric": {"__name__": name, **dict(labels)},
                     "values": [[t, repr(v)] for t, v in points]}
                    for (name, labels), points in self.samples.items() if name == m[1]]
        m = self.AGG.match(expr)
        assert m is not None, expr
        agg, by, fn, name = m[1], [b.strip() for b in (m[2] or "").split(",") if b], m[3], m[4]
        groups: dict[tuple[tuple[str, str], ...], list[float]] = {}
        for (n, labels), points in self.samples.items():
            if n == name:
                value = points[-1][1] - (0.0 if fn == "last_over_time" else points[0][1])
                key = tuple((k, v) for k, v in labels if k in by)
                groups.setdefault(key, []).append(value)
        reduce = {"sum": sum, "max": max, "count": len}[agg]
        return [{"metric": dict(key), "value": [1010.0, repr(float(reduce(values)))]}
                for key, values in groups.items()]


@pytest.fixture
def prometheus_api() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakePrometheus)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_prometheus_range_carries_the_growth_and_the_containers_labels(
        prometheus_api: str) -> None:
    # A range in which the run restarted on a larger dataset: both series are in it, the
    # larger first, and only it is named and counted.
    before: Container = ("dataset.paths", "list", "str", 2_000_000, 2.1e8)
    assert {cat.WORKER_PRIVATE_GROWTH, cat.DATASET_OBJECTS, cat.WORKER_MEMORY} <= set(
        promsource._LATEST)
    mem: dict[str, Any] = {"growth": 8 * 5 * PER_MINUTE, "room": 16 * GiB,
                           "containers": (before, PATHS)}
    first, second = (Scrape.parse(text) for text in texts(EIGHT, mem))
    FakePrometheus.samples = {key: [(1000.0, first.series.get(key, v)), (1010.0, v)]
                              for key, v in second.series.items()}
    window = promsource.window(prometheus_api, 600)
    [s] = loaders(window)
    assert s.workers.pss == 8 * 300 * MiB and s.workers.available == 16 * GiB
    assert s.workers.private_growth == pytest.approx(40 * PER_MINUTE)
    assert [(c.attribute, c.container, c.item, c.objects, c.bytes)
            for c in s.dataset_containers] == [PATHS, before]
    [d] = build_report("prometheus", MACHINE, [s], 1).diagnoses
    message = growth_of(d)
    assert message is not None and "`dataset.paths` is a list of 3,000,000 str" in message
    assert "2,000,000" not in message
    assert "each worker copies about the container's 0.30 GiB once, 2.38 GiB" in message
