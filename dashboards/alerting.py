"""Renders the alerts twice: Grafana unified-alerting file provisioning and a Prometheus
rule file, plus the promtool unit tests of the rule file.

The Grafana rules are written here against Grafana's documented file-provisioning format
rather than with grafanalib 0.7.1's AlertRulev9: that writes the ruler API's shape (rules
nested under ``grafana_alert`` with snake_case ``no_data_state``), gives expressions the
legacy datasource uid "-100" instead of "__expr__", and has no threshold expression.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from .model import DATASOURCE_UID, FOLDER, Alert, Case

GROUP = "dataloader"
INTERVAL = "1m"
EXPR_UID = "__expr__"  # Grafana's server-side expressions
# How far back each Grafana query looks; the expressions carry their own range windows.
LOOKBACK_SECONDS = 600
_TEMPLATE = re.compile(r"\{\{\s*\$labels\.(\w+)\s*\}\}")


def rule_annotations(alert: Alert) -> dict[str, str]:
    return {"summary": alert.summary, "description": alert.description}


def prometheus_rules(alerts: Sequence[Alert]) -> dict[str, Any]:
    """A Prometheus rule file (rule_files:) with one group holding every alert."""
    rules = [{"alert": a.name, "expr": a.expr, "for": a.for_, "labels": a.labels(),
              "annotations": rule_annotations(a)} for a in alerts]
    return {"groups": [{"name": GROUP, "rules": rules}]}


def grafana_rules(alerts: Sequence[Alert]) -> dict[str, Any]:
    """Grafana's alerting file provisioning (provisioning/alerting/*.yaml)."""
    group = {"orgId": 1, "name": GROUP, "folder": FOLDER, "interval": INTERVAL,
             "rules": [_grafana_rule(a) for a in alerts]}
    return {"apiVersion": 1, "groups": [group]}


def _grafana_rule(alert: Alert) -> dict[str, Any]:
    """A: the Prometheus query; B: its last value per series; C: B > 0, the condition.

    The alert's expression returns only positive values when it fires and nothing when
    it does not, so "no data" means OK, as it does in Prometheus.
    """
    query = {
        "refId": "A", "datasourceUid": DATASOURCE_UID,
        "relativeTimeRange": {"from": LOOKBACK_SECONDS, "to": 0},
        "model": {"refId": "A", "datasource": {"type": "prometheus", "uid": DATASOURCE_UID},
                  "editorMode": "code", "expr": alert.expr, "instant": True, "range": False,
                  "legendFormat": "__auto", "intervalMs": 1000, "maxDataPoints": 43200},
    }
    reduce = _expression("B", "reduce", "A", reducer="last", settings={"mode": "dropNN"})
    threshold = _expression("C", "threshold", "B", conditions=[{
        "evaluator": {"params": [0], "type": "gt"}, "operator": {"type": "and"},
        "query": {"params": ["C"]}, "reducer": {"params": [], "type": "last"},
        "type": "query"}])
    return {
        "uid": alert.uid, "title": alert.name, "condition": "C",
        "data": [query, reduce, threshold], "for": alert.for_,
        "noDataState": "OK", "execErrState": "Error",
        "annotations": rule_annotations(alert), "labels": alert.labels(),
    }


def _expression(ref: str, kind: str, source: str, **model: Any) -> dict[str, Any]:
    return {"refId": ref, "datasourceUid": EXPR_UID,
            "model": {"refId": ref, "type": kind, "expression": source,
                      "datasource": {"type": EXPR_UID, "uid": EXPR_UID},
                      "intervalMs": 1000, "maxDataPoints": 43200, **model}}


def expand(template: str, labels: dict[str, str]) -> str:
    """Expands {{ $labels.x }} as Prometheus and Grafana do; anything else is an error."""
    def label(m: re.Match[str]) -> str:
        if m.group(1) not in labels:
            raise ValueError(f"{template!r} uses label {m.group(1)!r}; the alert has "
                             f"{sorted(labels)}")
        return labels[m.group(1)]
    out = _TEMPLATE.sub(label, template)
    if "{{" in out:
        raise ValueError(f"unsupported template in {template!r}")
    return out


def promtool_tests(alerts: Sequence[Alert], cases: Sequence[Case],
                   rule_file: str = "rules.yml") -> dict[str, Any]:
    """A `promtool test rules` file: each case checks the alerts firing at its time and,
    where one fires, that the expression's values are positive (what Grafana needs)."""
    by_name = {a.name: a for a in alerts}
    tests = []
    for case in cases:
        alert = by_name[case.alert]
        expected = []
        for label_set in case.fires:
            labels = {**dict(label_set), **alert.labels()}
            expected.append({"exp_labels": labels, "exp_annotations": {
                k: expand(v, labels) for k, v in rule_annotations(alert).items()}})
        test: dict[str, Any] = {
            "name": f"{case.alert} {case.name}", "interval": "1m",
            "input_series": [{"series": series, "values": values}
                             for series, values in case.series],
            "alert_rule_test": [{"eval_time": case.eval_time, "alertname": case.alert,
                                 "exp_alerts": expected}],
        }
        if case.fires:
            test["promql_expr_test"] = [{
                "expr": f"(({alert.expr}) <= 0) or (({alert.expr}) != ({alert.expr}))",
                "eval_time": case.eval_time, "exp_samples": []}]
        tests.append(test)
    return {"rule_files": [rule_file], "evaluation_interval": "1m", "tests": tests}
