"""The alerts: Grafana's provisioning format, promtool's rule check, and promtool unit
tests where every alert fires once and stays quiet once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from support.rulefiles import FILES, promtool_run, write_rule_file
from test_dashboards import known_series, metric_names

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.dashboards import model
from dataloader_exporter.dashboards.alert_cases import CASES
from dataloader_exporter.dashboards.alerting import EXPR_UID, expand, prometheus_rules
from dataloader_exporter.dashboards.alerts import ALERTS, PSS_SHARE
from dataloader_exporter.dashboards.promql import GROWTH_HORIZON_S

GRAFANA = yaml.safe_load(FILES["grafana/provisioning/alerting/alerts.yaml"])
RULES = yaml.safe_load(FILES["prometheus/rules.yml"])
DURATION = re.compile(r"\d+[smhd]")


def test_every_alert_is_there_with_a_fix_in_its_description() -> None:
    names = [a.name for a in ALERTS]
    assert len(names) == len(set(names))
    assert names == [
        "DataLoaderInputBound", "DataLoaderInputStraggler", "DataLoaderEpochStartStall",
        "DataLoaderShmNearlyFull", "DataLoaderShmFull", "DataLoaderWorkerLost",
        "DataLoaderWorkersCpuStarved", "DataLoaderStalled",
        "DataLoaderExporterDown", "DataLoaderSnapshotsStale", "DataLoaderGpuCollectorDown",
        "DataLoaderHostMemoryPressure", "DataLoaderWorkerMemoryGrowth"]
    for a in ALERTS:
        assert "Fix" in a.description and a.summary, a.name
        assert "$" not in a.expr, f"{a.name}: alerts see every job, no dashboard variables"
    by_name = {a.name: a for a in ALERTS}
    assert "persistent_workers=True" in by_name["DataLoaderEpochStartStall"].description
    assert by_name["DataLoaderShmFull"].severity == model.CRITICAL
    assert by_name["DataLoaderInputBound"].for_ == "10m"
    lost = by_name["DataLoaderWorkerLost"]
    assert "{{ $labels.cause }}" in lost.summary and cat.FAILURES.name in lost.expr
    for cause in ("oom", "shm", "crash", "killed", "unknown"):
        assert f"{cause} (" in lost.description, cause  # each cause with its fix
    starved = by_name["DataLoaderWorkersCpuStarved"]
    assert cat.WORKER_TIME.name in starved.expr and "num_workers" in starved.description
    growth = by_name["DataLoaderWorkerMemoryGrowth"]
    assert growth.severity == model.WARNING and growth.for_ == "10m"
    # The trainer's growth gauge is the rate; the room, live workers and a rising PSS gate it.
    assert (f"{cat.WORKER_PRIVATE_GROWTH.name} * {GROWTH_HORIZON_S} > ignoring (kind) "
            f'{cat.WORKER_MEMORY.name}{{kind="available"}}') in growth.expr
    assert f" and ({cat.WORKERS_ACTIVE.name} > 0) and " in growth.expr
    assert f'deriv({cat.WORKER_MEMORY.name}{{kind="pss"}}[30m])' in growth.expr
    assert set(re.findall(r'kind="(\w+)"', growth.expr)) == {"available", "pss"}
    for words in ("copy-on-read", 'np.array(paths, dtype="S")', "pyarrow", "tensor",
                  cat.DATASET_OBJECTS.name, "dataloader-exporter doctor"):
        assert words in growth.description, words


# Each condition of DataLoaderWorkerMemoryGrowth weakened, and the case that catches it:
# the room matched on the rank alone (one loader's growth meets another's little room), no
# live workers asked for (the growth is kept after they end), and PSS asked only to rise
# (the brief slope of a stale gauge's flat PSS).
_ACTIVE = f" and ({cat.WORKERS_ACTIVE.name} > 0)"
WEAKENED = [("ignoring (kind)", "on (job, instance, rank) group_left ()", "only another"),
            (_ACTIVE, "", "workers ended"),
            (f" * {PSS_SHARE} > {cat.WORKER_PRIVATE_GROWTH.name})", " > 0)", "far slower")]


@pytest.mark.slow
@pytest.mark.parametrize(("old", "new", "caught_by"), WEAKENED)
def test_the_memory_growth_cases_catch_each_condition_weakened(
        tmp_path: Path, promtool: str, old: str, new: str, caught_by: str) -> None:
    wrong = prometheus_rules(ALERTS)
    for rule in wrong["groups"][0]["rules"]:
        if rule["alert"] == "DataLoaderWorkerMemoryGrowth":
            assert rule["expr"].count(old) == 1
            rule["expr"] = rule["expr"].replace(old, new)
    result = promtool_run(promtool, "test", "rules", str(write_rule_file(tmp_path, "rules",
                                                                          wrong)))
    assert result.returncode != 0
    out = result.stdout + result.stderr
    failed = re.findall(r"name: (DataLoaderWorkerMemoryGrowth [^,\n]*)", out)
    assert failed == [f"{c.alert} {c.name}" for c in CASES
                      if c.alert == "DataLoaderWorkerMemoryGrowth" and caught_by in c.name]


def test_every_metric_an_alert_names_is_in_the_catalogue() -> None:
    for a in ALERTS:
        names = metric_names(a.expr)
        assert names and names <= known_series(), (a.name, names - known_series())


def test_grafana_alert_provisioning_matches_the_documented_format() -> None:
    assert GRAFANA["apiVersion"] == 1
    (group,) = GRAFANA["groups"]
    assert group["orgId"] == 1 and group["name"] and group["folder"] == model.FOLDER
    assert DURATION.fullmatch(group["interval"])
    uids = [r["uid"] for r in group["rules"]]
    assert len(uids) == len(set(uids)) == len(ALERTS)
    for rule, alert in zip(group["rules"], ALERTS, strict=True):
        assert {"uid", "title", "condition", "data", "for", "noDataState", "execErrState",
                "annotations", "labels"} <= set(rule), rule["title"]
        assert re.fullmatch(r"[a-z0-9-]{1,40}", rule["uid"]), rule["uid"]
        assert rule["title"] == alert.name and DURATION.fullmatch(rule["for"])
        assert rule["noDataState"] in ("NoData", "Alerting", "OK")
        assert rule["execErrState"] in ("Error", "Alerting", "OK")
        for mapping in (rule["annotations"], rule["labels"]):
            assert all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items())
        assert set(rule["annotations"]) == {"summary", "description"}
        assert rule["labels"] == {"severity": alert.severity}
        refs = [d["refId"] for d in rule["data"]]
        assert len(refs) == len(set(refs)) and rule["condition"] in refs
        for i, entry in enumerate(rule["data"]):
            assert {"refId", "datasourceUid", "model"} <= set(entry)
            assert entry["model"]["refId"] == entry["refId"]
            if entry["datasourceUid"] == EXPR_UID:
                assert entry["model"]["type"] in ("reduce", "threshold", "math")
                assert entry["model"]["expression"] in refs[:i], "uses an earlier result"
            else:
                assert entry["datasourceUid"] == model.DATASOURCE_UID
                assert set(entry["relativeTimeRange"]) == {"from", "to"}
                m = entry["model"]
                assert m["expr"] == alert.expr and m["instant"] is True and m["range"] is False
                assert isinstance(m["intervalMs"], int) and isinstance(m["maxDataPoints"], int)
        threshold = rule["data"][-1]["model"]
        assert threshold["type"] == "threshold" and rule["condition"] == threshold["refId"]
        assert threshold["conditions"][0]["evaluator"] == {"params": [0], "type": "gt"}


def test_grafana_and_prometheus_carry_the_same_alerts() -> None:
    prom = {r["alert"]: r for r in RULES["groups"][0]["rules"]}
    for rule in GRAFANA["groups"][0]["rules"]:
        twin = prom[rule["title"]]
        assert twin["expr"] == rule["data"][0]["model"]["expr"]
        assert twin["for"] == rule["for"] and twin["labels"] == rule["labels"]
        assert twin["annotations"] == rule["annotations"]


def test_the_rule_file_passes_promtool_check_rules(tmp_path: Path, promtool: str) -> None:
    write_rule_file(tmp_path, "rules")
    result = promtool_run(promtool, "check", "rules", str(tmp_path / "rules.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in result.stdout


def test_every_alert_has_a_case_where_it_fires_and_one_where_it_stays_quiet() -> None:
    names = {a.name for a in ALERTS}
    assert {c.alert for c in CASES} == names
    for name in names:
        assert any(c.fires for c in CASES if c.alert == name), f"{name} never fires"
        assert any(not c.fires for c in CASES if c.alert == name), f"{name} never quiet"
    tests = yaml.safe_load(FILES["prometheus/rules.test.yml"])["tests"]
    assert len(tests) == len(CASES) and len({t["name"] for t in tests}) == len(CASES)


@pytest.mark.slow
def test_promtool_unit_tests_pass_for_every_alert(tmp_path: Path, promtool: str) -> None:
    result = promtool_run(promtool, "test", "rules", str(write_rule_file(tmp_path, "rules")))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_the_unit_tests_catch_an_alert_that_never_fires(tmp_path: Path, promtool: str) -> None:
    """A rule file whose alerts can never fire fails a firing case of every alert."""
    silent = prometheus_rules(ALERTS)
    for rule in silent["groups"][0]["rules"]:
        rule["expr"] = "vector(1) > 2"
    tests = write_rule_file(tmp_path, "rules", silent)
    result = promtool_run(promtool, "test", "rules", str(tests))
    assert result.returncode != 0
    for a in ALERTS:
        assert f"alertname: {a.name}," in result.stdout + result.stderr, a.name


def test_annotation_templates_expand_only_labels_the_alert_has() -> None:
    assert expand("{{ $labels.rank }} on {{$labels.instance}}",
                  {"rank": "0", "instance": "h:1"}) == "0 on h:1"
    for bad in ("{{ $labels.gpu }}", "{{ $value }}"):
        try:
            expand(bad, {"rank": "0"})
        except ValueError:
            continue
        raise AssertionError(f"{bad} expanded")
