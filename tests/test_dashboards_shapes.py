"""The generated dashboards have the keys and value types a current Grafana writes for
each panel type, compared with a dashboard Grafana 11.6 exported (schemaVersion 41)."""

from __future__ import annotations

import json
from typing import Any

from test_dashboards import RENDERED, REPO, variables

from dataloader_exporter.dashboards import model
from dataloader_exporter.dashboards.render import SCHEMA_VERSION

# A dashboard Grafana exported, committed with its origin and licence (tests/reference/).
REFERENCE = REPO / "tests" / "reference" / "grafana" / "node-exporter-full.json"
PANEL_TYPES = {"row", *model.KINDS}

# For each panel type, the keys every panel of that type has in the reference export
# (Grafana 11.6.1, schemaVersion 41) with their JSON types. test_the_reference_shapes_are_
# those_of_the_grafana_export re-derives this table from the export (REFERENCE).
_PANEL = ("datasource:object description:string fieldConfig:object gridPos:object id:number "
          "options:object pluginVersion:string targets:array title:string type:string")
REFERENCE_SHAPES: dict[str, dict[str, str]] = {
    "row": {"panel": "collapsed:boolean gridPos:object id:number panels:array title:string "
                     "type:string"},
    "timeseries": {
        "panel": _PANEL.replace(" pluginVersion:string", ""),
        "defaults": "color:object custom:object links:array mappings:array thresholds:object "
                    "unit:string",
        "options": "legend:object tooltip:object",
        "custom": "axisBorderShow:boolean axisCenteredZero:boolean axisColorMode:string "
                  "axisLabel:string axisPlacement:string barAlignment:number "
                  "barWidthFactor:number drawStyle:string fillOpacity:number "
                  "gradientMode:string hideFrom:object insertNulls:boolean "
                  "lineInterpolation:string lineWidth:number pointSize:number "
                  "scaleDistribution:object spanNulls:boolean stacking:object "
                  "thresholdsStyle:object"},
    "stat": {
        "panel": _PANEL + " maxDataPoints:number",
        "defaults": "color:object mappings:array thresholds:object unit:string",
        "options": "colorMode:string graphMode:string justifyMode:string orientation:string "
                   "percentChangeColorMode:string reduceOptions:object "
                   "showPercentChange:boolean textMode:string wideLayout:boolean"},
    "gauge": {
        "panel": _PANEL,
        "defaults": "color:object decimals:number mappings:array max:number min:number "
                    "thresholds:object unit:string",
        "options": "minVizHeight:number minVizWidth:number orientation:string "
                   "reduceOptions:object showThresholdLabels:boolean "
                   "showThresholdMarkers:boolean sizing:string"},
    "bargauge": {
        "panel": _PANEL,
        "defaults": "color:object links:array mappings:array thresholds:object unit:string",
        "options": "displayMode:string legend:object maxVizHeight:number minVizHeight:number "
                   "minVizWidth:number namePlacement:string orientation:string "
                   "reduceOptions:object showUnfilled:boolean sizing:string valueMode:string"},
}
REFERENCE_VARIABLES = {
    "datasource": "current:object includeAll:boolean label:string name:string options:array "
                  "query:string refresh:number regex:string type:string",
    "query": "current:object datasource:object definition:string includeAll:boolean "
             "label:string name:string options:array query:object refresh:number "
             "regex:string sort:number type:string",
}
REFERENCE_DASHBOARD = (
    "annotations:object editable:boolean fiscalYearStartMonth:number graphTooltip:number "
    "id:null links:array panels:array refresh:string schemaVersion:number tags:array "
    "templating:object time:object timepicker:object timezone:string title:string "
    "uid:string version:number weekStart:string")
SECTIONS = {
    "panel": lambda p: p,
    "defaults": lambda p: p.get("fieldConfig", {}).get("defaults"),
    "options": lambda p: p.get("options"),
    "custom": lambda p: p.get("fieldConfig", {}).get("defaults", {}).get("custom"),
}


def json_type(value: Any) -> str:
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}[type(value)]


def shape(objects: list[dict[str, Any]]) -> str:
    """The keys all objects share, each with its JSON type(s), as 'key:type ...'."""
    keys = set.intersection(*(set(o) for o in objects))
    return " ".join(f"{k}:{'|'.join(sorted({json_type(o[k]) for o in objects}))}"
                    for k in sorted(keys))


def parse_shape(text: str) -> dict[str, str]:
    return dict(item.split(":") for item in text.split())


def reference_shapes(dashboard: dict[str, Any]) -> dict[str, dict[str, str]]:
    by_type: dict[str, list[dict[str, Any]]] = {}
    for p in dashboard["panels"]:
        by_type.setdefault(p["type"], []).append(p)
        for q in p.get("panels", []):
            by_type.setdefault(q["type"], []).append(q)
    out: dict[str, dict[str, str]] = {}
    for kind, ps in by_type.items():
        sections = {name: [f(p) for p in ps] for name, f in SECTIONS.items()}
        out[kind] = {name: shape(objs) for name, objs in sections.items()
                     if all(isinstance(o, dict) for o in objs) and shape(objs)}
    return out


def test_the_reference_shapes_are_those_of_the_grafana_export() -> None:
    ref = json.loads(REFERENCE.read_text())
    assert ref["schemaVersion"] == SCHEMA_VERSION
    derived = reference_shapes(ref)
    for kind in REFERENCE_SHAPES:
        assert {k: parse_shape(v) for k, v in derived[kind].items()} == {
            k: parse_shape(v) for k, v in REFERENCE_SHAPES[kind].items()}, kind
    by_type: dict[str, list[dict[str, Any]]] = {}
    for v in ref["templating"]["list"]:
        by_type.setdefault(v["type"], []).append(v)
    for kind, text in REFERENCE_VARIABLES.items():
        assert parse_shape(shape(by_type[kind])) == parse_shape(text), kind
    top = {k: v for k, v in ref.items() if k != "__requires"}
    assert parse_shape(shape([top])) == parse_shape(REFERENCE_DASHBOARD)


def assert_has_shape(obj: dict[str, Any], expected: str, where: str) -> None:
    for key, types in parse_shape(expected).items():
        assert key in obj, f"{where}: missing {key}"
        assert json_type(obj[key]) in types.split("|"), f"{where}.{key}: {obj[key]!r}"


def test_panels_variables_and_dashboards_have_the_keys_and_types_grafana_writes() -> None:
    for uid, data in RENDERED.items():
        assert data["schemaVersion"] == SCHEMA_VERSION == 41
        assert_has_shape(data, REFERENCE_DASHBOARD, uid)
        for p in data["panels"]:
            assert p["type"] in PANEL_TYPES, p["type"]  # no legacy graph or singlestat
            for section, expected in REFERENCE_SHAPES[p["type"]].items():
                obj = SECTIONS[section](p)
                assert isinstance(obj, dict), (p["title"], section)
                assert_has_shape(obj, expected, f"{uid}/{p['title']}/{section}")
            assert "fieldOptions" not in p.get("options", {}), p["title"]
        for v in variables(uid):
            assert_has_shape(v, REFERENCE_VARIABLES[v["type"]], f"{uid}/${v['name']}")
