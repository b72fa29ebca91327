"""Renders a Board with grafanalib into the JSON model a current Grafana loads.

grafanalib 0.7.1 builds the dashboard, rows, panels, targets and variables, but still
writes some Grafana 6-era shapes: gauge and bar gauge options under ``fieldOptions``
(Grafana migrates those over the current ones when ``pluginVersion`` is missing), an
``intervalFactor`` of 2 that halves query resolution, ``schemaVersion`` 12. The current
shapes, taken from a dashboard Grafana 11.6 exported (schemaVersion 41), go in through
grafanalib's ``extraJson``; the legacy keys are pruned, so Grafana has nothing to migrate.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import grafanalib.core as g
from grafanalib._gen import DashboardEncoder

from .model import (
    BARGAUGE,
    DATASOURCE_UID,
    GAUGE,
    STAT,
    TIMESERIES,
    Board,
    Panel,
    Step,
    Variable,
)

SCHEMA_VERSION = 41
PLUGIN_VERSION = "11.6.1"  # the panel-options shape written here is Grafana 11.6's
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24
WIDTH = {TIMESERIES: 12, STAT: 6, GAUGE: 6, BARGAUGE: 12}
HEIGHT = {TIMESERIES: 8, STAT: 5, GAUGE: 5, BARGAUGE: 8}
ALL = {"selected": True, "text": ["All"], "value": ["$__all"]}
BUILT_IN_ANNOTATIONS = {
    "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
    "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
    "type": "dashboard",
}
STACKED_FILL = 60  # stacked parts are areas: filled enough to read which is which
REDUCE_LAST = {"calcs": ["lastNotNull"], "fields": "", "values": False}

# Keys grafanalib 0.7.1 writes that current Grafana does not (dotted paths).
_LEGACY_PANEL = ("editable", "error")
_LEGACY = {
    TIMESERIES: ("maxDataPoints",),  # 100 points caps the graph's resolution
    STAT: (),
    GAUGE: ("fieldConfig.defaults.calcs", "fieldConfig.defaults.override",
            "fieldConfig.defaults.values", "fieldConfig.defaults.limit",
            "fieldConfig.showThresholdLabels", "fieldConfig.showThresholdMarkers"),
    BARGAUGE: ("options.fieldOptions", "options.showThresholdLabels",
               "options.showThresholdMarkers"),
}
_LEGACY_TARGET = ("target", "metric", "query", "step")  # Graphite and pre-7 leftovers
_LEGACY_DASHBOARD = ("rows", "hideControls", "sharedCrosshair", "style", "__inputs")
_LEGACY_VARIABLE = ("useTags", "tagsQuery", "tagValuesQuery", "auto", "auto_min",
                    "auto_count")
_ROW_KEYS = ("collapsed", "gridPos", "id", "panels", "title", "type")


def render(board: Board) -> dict[str, Any]:
    """The dashboard's JSON model, with panel ids, refIds and grid positions computed."""
    panels: list[Any] = []
    y = 0
    for row in board.rows:
        panels.append(g.RowPanel(title=row.title, gridPos=g.GridPos(h=1, w=GRID_WIDTH, x=0, y=y)))
        positions, y = layout(row.panels, y + 1)
        panels += [_panel(p, pos) for p, pos in zip(row.panels, positions, strict=True)]
    dashboard = g.Dashboard(
        title=board.title, uid=board.uid, description=board.description,
        tags=list(board.tags), panels=panels, schemaVersion=SCHEMA_VERSION,
        templating=g.Templating(list=[_variable(v) for v in board.variables]),
        annotations=g.Annotations(list=[BUILT_IN_ANNOTATIONS]),
        time=g.Time("now-1h", "now"), timezone="browser", refresh="30s",
        graphTooltip=g.GRAPH_TOOLTIP_MODE_SHARED_CROSSHAIR, version=1,
    ).auto_panel_ids()
    data = _strip_none(json.loads(json.dumps(dashboard.to_json_data(), cls=DashboardEncoder)))
    for key in _LEGACY_DASHBOARD:
        data.pop(key, None)
    data.update(id=None, fiscalYearStartMonth=0, weekStart="")
    data["panels"] = [_prune(p) for p in data["panels"]]
    return dict(data)


def layout(panels: Sequence[Panel], y: int) -> tuple[list[g.GridPos], int]:
    """Grid positions flowing left to right; a line that is not full is shared evenly,
    and its panels take the tallest one's height. Returns them and the next free y."""
    lines: list[list[Panel]] = [[]]
    for p in panels:
        if sum(WIDTH[q.kind] for q in lines[-1]) + WIDTH[p.kind] > GRID_WIDTH:
            lines.append([])
        lines[-1].append(p)
    positions = []
    for line in filter(None, lines):
        widths = [WIDTH[p.kind] for p in line]
        if sum(widths) < GRID_WIDTH:
            widths = [GRID_WIDTH // len(line)] * len(line)
            widths[-1] += GRID_WIDTH - sum(widths)
        height = max(HEIGHT[p.kind] for p in line)
        x = 0
        for w in widths:
            positions.append(g.GridPos(h=height, w=w, x=x, y=y))
            x += w
        y += height
    return positions, y


def _steps(thresholds: Sequence[Step]) -> list[dict[str, Any]]:
    steps = thresholds or ((None, "green"),)
    return [{"color": color, "value": value} for value, color in steps]


def _targets(p: Panel, instant: bool) -> list[dict[str, Any]]:
    targets = []
    for i, (legend, expr) in enumerate(p.targets):
        t = g.Target(expr=expr, legendFormat=legend, refId=chr(ord("A") + i), instant=instant,
                     datasource=DATASOURCE, intervalFactor=1)
        targets.append({**t.to_json_data(), "editorMode": "code", "exemplar": False,
                        "range": not instant})
    return targets


def _panel(p: Panel, pos: g.GridPos) -> Any:
    instant = p.kind in (GAUGE, BARGAUGE)  # they show the current value only
    defaults: dict[str, Any] = {"color": {"mode": "thresholds"}, "links": [], "mappings": [],
                                "unit": p.unit, "min": p.min, "max": p.max}
    extra: dict[str, Any] = {"pluginVersion": PLUGIN_VERSION, "fieldConfig": {"overrides": []}}
    common: dict[str, Any] = {
        "title": p.title, "description": p.description, "dataSource": DATASOURCE,
        "targets": _targets(p, instant), "gridPos": pos, "thresholds": _steps(p.thresholds),
    }
    if p.kind == TIMESERIES:
        defaults["color"] = {"mode": "palette-classic"}
        defaults["custom"] = {
            "axisBorderShow": False, "axisCenteredZero": False, "axisColorMode": "text",
            "barWidthFactor": 0.6, "insertNulls": False,
            "thresholdsStyle": {"mode": "line+area" if p.thresholds else "off"},
        }
        extra["fieldConfig"]["defaults"] = defaults
        extra["options"] = {"legend": {"showLegend": True}}
        return g.TimeSeries(**common, unit=p.unit, fillOpacity=STACKED_FILL if p.stack else 10,
                            tooltipMode="multi", tooltipSort="desc",
                            stacking={"group": "A", "mode": "normal" if p.stack else "none"},
                            extraJson=extra)
    if p.kind == STAT:
        extra["fieldConfig"]["defaults"] = defaults
        extra["options"] = {"percentChangeColorMode": "standard", "showPercentChange": False,
                            "wideLayout": True}
        return g.Stat(**common, format=p.unit, reduceCalc="lastNotNull", noValue=None,
                      extraJson=extra)
    if p.kind == GAUGE:
        extra["fieldConfig"]["defaults"] = {**defaults, "decimals": 1}
        extra["options"] = {"minVizHeight": 75, "minVizWidth": 75, "orientation": "auto",
                            "reduceOptions": REDUCE_LAST, "showThresholdLabels": False,
                            "showThresholdMarkers": True, "sizing": "auto"}
        return g.GaugePanel(**common, format=p.unit, min=p.min, max=p.max, extraJson=extra)
    extra["fieldConfig"]["defaults"] = defaults
    extra["options"] = {
        "displayMode": "gradient", "maxVizHeight": 300, "minVizHeight": 16, "minVizWidth": 8,
        "namePlacement": "auto", "reduceOptions": REDUCE_LAST, "showUnfilled": True,
        "sizing": "auto", "valueMode": "color",
        "legend": {"calcs": [], "displayMode": "list", "placement": "bottom",
                   "showLegend": False},
    }
    return g.BarGauge(**common, format=p.unit, orientation=g.ORIENTATION_HORIZONTAL,
                      extraJson=extra)


def _variable(v: Variable) -> dict[str, Any]:
    if not v.query:
        t = g.Template(name=v.name, label=v.label, query="prometheus", type="datasource",
                       regex="", refresh=g.REFRESH_ON_DASHBOARD_LOAD)
        current: dict[str, Any] = {"selected": True, "text": "Prometheus",
                                   "value": DATASOURCE_UID}
        extra: dict[str, Any] = {}
    else:
        t = g.Template(name=v.name, label=v.label, dataSource=DATASOURCE, type="query",
                       query={"qryType": 1, "query": v.definition,
                              "refId": "PrometheusVariableQueryEditor-VariableQuery"},
                       includeAll=True, multi=True, allValue=".*", regex="",
                       refresh=g.REFRESH_ON_TIME_RANGE_CHANGE, sort=g.SORT_ALPHA_ASC)
        current, extra = ALL, {"definition": v.definition}
    data = {**t.to_json_data(), "current": current, **extra}
    for key in _LEGACY_VARIABLE:
        data.pop(key, None)
    return data


def _prune(panel: dict[str, Any]) -> dict[str, Any]:
    if panel["type"] == "row":
        return {k: panel[k] for k in _ROW_KEYS}
    for path in _LEGACY_PANEL + _LEGACY[panel["type"]]:
        *parents, leaf = path.split(".")
        node = panel
        for key in parents:
            node = node.get(key, {})
        node.pop(leaf, None)
    for target in panel["targets"]:
        for key in _LEGACY_TARGET:
            target.pop(key, None)
    return panel


def _strip_none(value: Any) -> Any:
    """Drops null members, as Grafana's own export does for unset options."""
    if isinstance(value, dict):
        return {k: _strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_none(v) for v in value]
    return value
