"""The generated dashboards: structure, queries, and the committed copies under deploy/
being the generated ones. Shapes against a Grafana export: test_dashboards_shapes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.dashboards import build, dcgm, model, recording
from dataloader_exporter.dashboards.alerts import ALERTS
from dataloader_exporter.dashboards.promql import GROWTH_HORIZON_S
from dataloader_exporter.dashboards.render import render

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
RENDERED = {b.uid: render(b) for b in build.BOARDS}
# Series Prometheus makes itself rather than the exporter, the recording rules' series,
# and dcgm-exporter's (joined per pod in Kubernetes).
PROMETHEUS_SERIES = {"up", *recording.NAMES, *dcgm.NAMES}
GRAFANA_GLOBALS = {"__rate_interval", "__interval", "__range", "__all"}

# --- PromQL parsing, shared with test_alerts ------------------------------------------------
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NUMBER = re.compile(r"(?<![\w:])\d+(\.\d+)?([eE][+-]?\d+)?")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
             "group_left", "group_right", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects: identifiers outside strings, label
    matchers, ranges and grouping clauses that are neither functions nor keywords."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\boffset\s+\d+[smhdwy]", " ", text)  # offset 10m: a modifier
    text = _GROUPING.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        if text[m.end():].lstrip().startswith("(") or m.group().lower() in _KEYWORDS:
            continue
        names.add(m.group())
    return names


def known_series() -> set[str]:
    return {s for m in cat.ALL for s in cat.series_names(m)} | PROMETHEUS_SERIES


def label_values_selector(definition: str) -> str:
    m = re.fullmatch(r"label_values\((.+), (\w+)\)", definition)
    assert m, definition
    return m.group(1)


# --- walking the rendered JSON --------------------------------------------------------------
def panels(uid: str | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    for board_uid, data in RENDERED.items():
        if uid in (None, board_uid):
            for p in data["panels"]:
                yield board_uid, p


def targets() -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    for uid, p in panels():
        for t in p.get("targets", []):
            yield uid, p, t


def variables(uid: str) -> list[dict[str, Any]]:
    return list(RENDERED[uid]["templating"]["list"])


def test_panel_ids_are_unique_and_panels_tile_the_grid_without_overlap() -> None:
    for uid, data in RENDERED.items():
        ids = [p["id"] for p in data["panels"]]
        assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids), uid
        cells: set[tuple[int, int]] = set()
        for p in data["panels"]:
            g = p["gridPos"]
            assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, (uid, p["title"])
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                    for y in range(g["y"], g["y"] + g["h"])}
            assert not cells & mine, f"{p['title']} overlaps another panel"
            cells |= mine


def test_refids_are_unique_within_each_panel() -> None:
    for uid, p in panels():
        refs = [t["refId"] for t in p.get("targets", [])]
        assert len(refs) == len(set(refs)) and all(refs), (uid, p["title"])


def test_titles_are_unique_within_each_dashboard() -> None:
    for uid, data in RENDERED.items():
        titles = [p["title"] for p in data["panels"]]
        assert len(titles) == len(set(titles)), uid


def test_every_metric_a_query_names_is_in_the_catalogue() -> None:
    for uid, p, t in targets():
        names = metric_names(t["expr"])
        assert names, (uid, p["title"], t["expr"])
        assert names <= known_series(), (p["title"], names - known_series())
    for data in RENDERED.values():
        for v in data["templating"]["list"]:
            if v["type"] == "query":
                assert metric_names(label_values_selector(v["definition"])) <= known_series()
    assert metric_names('sum by (le) (rate(a_bucket{x="y"}[5m])) / on (i) b > 1e3') == {
        "a_bucket", "b"}


def test_every_variable_used_is_defined_and_every_defined_one_is_used() -> None:
    for uid, data in RENDERED.items():
        defined = {v["name"] for v in variables(uid)}
        text = json.dumps([data["panels"], data["templating"]])
        # $1 in label_replace is a regex group, not a variable (Grafana leaves it be).
        used = set(re.findall(r"\$\{?([A-Za-z_]\w*)", text)) - GRAFANA_GLOBALS
        assert used == defined, (uid, used ^ defined)
        assert {"datasource", "job"} <= defined
        # Boards on raw series pick instances; the jobs board reads recorded series.
        assert ("instance" in defined) is (uid != "dataloader-jobs"), uid


def test_overview_variables_are_datasource_job_instance_loader_and_rank_with_all() -> None:
    vs = {v["name"]: v for v in variables("dataloader-overview")}
    assert list(vs) == ["datasource", "job", "instance", "loader", "rank"]
    assert vs["datasource"]["type"] == "datasource" and vs["datasource"]["query"] == "prometheus"
    assert vs["datasource"]["current"]["value"] == model.DATASOURCE_UID
    for name in ("job", "instance", "loader", "rank"):
        v = vs[name]
        assert v["multi"] and v["includeAll"] and v["allValue"] == ".*", name
        assert v["query"]["query"] == v["definition"] and v["definition"].endswith(f", {name})")
        assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_queries_use_regex_matchers_for_variables_and_the_rate_interval() -> None:
    for _, p, t in targets():
        expr = t["expr"]
        assert not re.search(r'[^~]"\$[A-Za-z_]', expr), (p["title"], expr)  # $var only after =~
        for window in re.findall(r"\[([^\]]+)\]", expr):
            assert window == "$__rate_interval", (p["title"], expr)
        assert t["datasource"] == p["datasource"] == {"type": "prometheus",
                                                      "uid": "${datasource}"}
        assert t["intervalFactor"] == 1 and t["instant"] is not t["range"]


def strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)


def test_no_placeholder_is_left_and_legends_name_real_labels() -> None:
    labels = {label for m in cat.ALL for label in m.labels} | {
        "job", "instance", "namespace", "pod"}  # the last two from Kubernetes discovery
    for uid, data in RENDERED.items():
        for text in strings(data):
            for bad in ("None", "TODO", "FIXME", "XXX", "%s", "{}", "[]"):
                assert bad not in text, (uid, text)
            # a str.format field left unfilled: {name} that is neither {{legend}} nor a matcher
            assert not re.search(r"(?<![{$])\{\w+\}(?!\})", text), (uid, text)
    for _, _, t in targets():
        assert set(re.findall(r"\{\{(\w+)\}\}", t["legendFormat"])) <= labels, t["legendFormat"]


def test_every_panel_says_what_good_looks_like_and_has_a_unit() -> None:
    for board in build.BOARDS:
        for p in board.panels():
            assert "Good" in p.description and len(p.description) > 80, p.title
            assert p.unit, p.title
    for _, p in panels():
        if p["type"] != "row":
            assert p["fieldConfig"]["defaults"]["unit"], p["title"]


def test_the_overview_has_every_panel_of_the_input_pipeline() -> None:
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"])
             for _, p in panels("dataloader-overview") if p["type"] != "row"}
    stall = exprs["Input stall share"]
    assert f"{cat.TIME.name}_sum" in stall and f"{cat.STEP.name}_sum" in stall
    assert [s["value"] for s in next(
        p for _, p in panels("dataloader-overview") if p["title"] == "Input stall share"
    )["fieldConfig"]["defaults"]["thresholds"]["steps"][1:]] == [0.05, 0.2]
    assert exprs["Fetch wait per batch"].count("histogram_quantile") == 3
    assert cat.TRANSFER_BYTES.name in exprs["Effective host-to-device bandwidth"]
    assert cat.GPU_UTILIZATION.name in exprs["GPU utilization and input stall share"]
    # Across ranks: the job-level stall (not a mean), stragglers, the wait for other ranks.
    job = exprs["Input stall share of the job"]
    assert "max by (namespace, job, loader)" in job and "avg" not in job
    assert "quantile by (namespace, job, loader) (0.5" in exprs["Input stragglers by rank"]
    assert "topk(10" in exprs["Input stragglers by rank"]
    assert "min by (namespace, job, loader)" in exprs["Step: waiting for other ranks (estimate)"]
    assert "on (gpu_uuid)" in exprs["Each rank's GPU beside its input stall share"]
    for metric in (cat.SAMPLES, cat.BATCHES, cat.FIRST_BATCH, cat.WORKERS_ACTIVE,
                   cat.WORKERS_CONFIGURED, cat.WORKER_CPU, cat.BATCH_BYTES, cat.SHM_USED,
                   cat.SHM_SIZE, cat.HOST_MEMORY_AVAILABLE, cat.HOST_SWAP_USED):
        assert any(metric.name in e for e in exprs.values()), metric.name
    gpu = " ".join(t["expr"] for uid, _, t in targets() if uid == "dataloader-gpu")
    for metric in (cat.GPU_UTILIZATION, cat.GPU_MEMORY_USED, cat.GPU_PCIE_RX, cat.GPU_PCIE_TX,
                   cat.GPU_TEMPERATURE, cat.GPU_POWER):
        assert metric.name in gpu, metric.name


def test_the_overview_shows_where_the_workers_time_goes_their_memory_and_failures() -> None:
    shown = {p["title"]: p for _, p in panels("dataloader-overview") if p["type"] != "row"}
    exprs = {title: " ".join(t["expr"] for t in p["targets"]) for title, p in shown.items()}
    states = shown["Worker time by state"]
    assert states["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert exprs["Worker time by state"].startswith("sum by (loader, state) (rate(")
    assert cat.WORKER_TIME.name in exprs["Worker time by state"]
    assert {t["legendFormat"] for t in shown["Worker memory"]["targets"]} == {
        "{{loader}} {{kind}}", "{{loader}} largest worker (rss)",
        "{{loader}} available (tightest rank)"}
    # PSS (RSS where PSS cannot be read) and swap; the room is a line of its own.
    assert 'kind!="available"' in exprs["Worker memory"]
    # The growth the trainer measures, projected as the alert projects it, against the room.
    growth = exprs["Worker memory growth"]
    assert {t["legendFormat"] for t in shown["Worker memory growth"]["targets"]} == {
        "{{loader}} growth in 6 h at the measured rate (fastest rank)",
        "{{loader}} available (tightest rank)", "{{loader}} pss (largest rank)",
        "{{loader}} {{attribute}}: {{container}} of {{objects}} {{item}} (each worker)"}
    assert 'kind="pss"' in growth and 'kind="available"' in growth
    assert f"{cat.WORKER_PRIVATE_GROWTH.name}{{" in growth and f") * {GROWTH_HORIZON_S}" in growth
    assert f"* {GROWTH_HORIZON_S} >" in next(a.expr for a in ALERTS
                                            if a.name == "DataLoaderWorkerMemoryGrowth")
    assert "by (loader, attribute, container, item, objects)" in growth
    assert "DataLoaderWorkerMemoryGrowth" in shown["Worker memory growth"]["description"]
    for title, metric in (("Worker memory", cat.WORKER_MEMORY),
                          ("Worker memory", cat.WORKER_MAX_RSS),
                          ("Worker memory growth", cat.WORKER_PRIVATE_GROWTH),
                          ("Worker memory growth", cat.DATASET_OBJECTS),
                          ("Worker reads", cat.WORKER_READ),
                          ("Worker major page faults", cat.WORKER_MAJOR_FAULTS),
                          ("Worker failures by cause", cat.FAILURES)):
        assert metric.name in exprs[title], (title, metric.name)
    stacked = [title for title, p in shown.items() if p["type"] == "timeseries" and
               p["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] != "none"]
    assert stacked == ["Worker time by state"]  # only parts of a whole stack


def test_only_time_series_stack() -> None:
    with pytest.raises(ValueError, match="only time series stack"):
        model.Panel("x", "Good: y", model.COUNT, (("a", "b"),), model.STAT, stack=True)


# --- the committed output ----------------------------------------------------------------------
def test_the_committed_deploy_files_are_the_generated_ones(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "dataloader_exporter", "dashboards", "--out",
                             str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    generated = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert generated == set(build.files())
    stale = []
    for rel in sorted(generated):
        committed = DEPLOY / rel
        if not committed.is_file() or committed.read_bytes() != (tmp_path / rel).read_bytes():
            stale.append(rel)
    ours = {p.relative_to(DEPLOY).as_posix() for p in (DEPLOY / "grafana").rglob("*")
            if p.is_file()}
    stale += sorted(ours - generated)
    assert not stale, f"out of date: {stale}; regenerate with `make dashboards`"
    for text in build.files().values():
        assert text.endswith("\n") and not text.endswith("\n\n")


def test_generating_twice_gives_the_same_bytes() -> None:
    assert build.files() == build.files()


def test_provisioning_points_everything_at_one_datasource_uid() -> None:
    ds = yaml.safe_load(build.files()["grafana/provisioning/datasources/prometheus.yaml"])
    (source,) = ds["datasources"]
    assert source["uid"] == model.DATASOURCE_UID and source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    provider = yaml.safe_load(build.files()["grafana/provisioning/dashboards/dashboards.yaml"])
    assert provider["providers"][0]["options"]["path"] == build.DASHBOARDS_PATH


def test_the_compose_stack_mounts_what_is_generated_where_grafana_looks() -> None:
    compose_file = REPO / "docker-compose.yml"
    prometheus_file = DEPLOY / "prometheus" / "prometheus.yml"
    if not (compose_file.is_file() and prometheus_file.is_file()):
        pytest.skip("no compose stack in this checkout")
    services = yaml.safe_load(compose_file.read_text())["services"]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"] if v.startswith("."))
    assert mounts["./deploy/grafana/dashboards"] == build.DASHBOARDS_PATH
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    config = yaml.safe_load(prometheus_file.read_text())
    assert "rules.yml" in config["rule_files"]
    job = next(j for j in config["scrape_configs"] if j["job_name"] == model.EXPORTER_JOB)
    assert job.get("scrape_interval", config["global"]["scrape_interval"]) == \
        build.SCRAPE_INTERVAL


def test_the_serve_command_does_not_import_grafanalib() -> None:
    code = ("import sys, dataloader_exporter.cli, dataloader_exporter.exporter.serve_cli, "
            "dataloader_exporter.core.catalogue; sys.exit('grafanalib' in sys.modules or "
            "'dataloader_exporter.dashboards' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60).returncode == 0
