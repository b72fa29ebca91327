"""Dashboards and alerts as data: small frozen dataclasses, rendered elsewhere.

A dashboard is a list of rows of panels; a panel is a title, a description (what good
looks like and what to change when it is bad), a unit and its queries as (legend, expr)
pairs. Ids, refIds and grid positions are not here: the renderer computes them. An
alert is defined once here and rendered twice (Grafana provisioning, Prometheus rules).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The uid of the provisioned Prometheus datasource: datasource provisioning, the
# dashboards' default datasource and every Grafana alert query point at it.
DATASOURCE_UID = "prometheus"
DATASOURCE_URL = "http://prometheus:9090"
# The folder both the dashboards and the Grafana alert rules are provisioned into.
FOLDER = "DataLoader"
# The scrape job the exporter-down alert watches (Prometheus's job_name for the exporter).
EXPORTER_JOB = "dataloader-exporter"
# In Kubernetes the PodMonitor names `job` after the training job; the sidecar's targets
# are told apart by their `container` label (Prometheus Operator adds it).
EXPORTER_CONTAINER = "dataloader-exporter"

# Panel kinds: Grafana's current panel types (no legacy "graph" or "singlestat").
TIMESERIES = "timeseries"
STAT = "stat"
GAUGE = "gauge"
BARGAUGE = "bargauge"
KINDS = (TIMESERIES, STAT, GAUGE, BARGAUGE)

# Grafana unit ids used by the panels.
RATIO = "percentunit"  # 0-1 shown as a percentage
SECONDS = "s"
BYTES = "bytes"  # IEC: KiB, MiB
BYTES_PER_SECOND = "Bps"
COUNT = "short"
CELSIUS = "celsius"
WATTS = "watt"

WARNING = "warning"
CRITICAL = "critical"

# A threshold step: (lower bound, colour); the first step's bound is None (from -inf).
Step = tuple[float | None, str]


@dataclass(frozen=True)
class Panel:
    """One panel: what it shows, why, in which unit, from which queries."""

    title: str
    description: str
    unit: str
    targets: tuple[tuple[str, str], ...]  # (legend, PromQL expr)
    kind: str = TIMESERIES
    thresholds: tuple[Step, ...] = ()
    min: float | None = 0
    max: float | None = None
    stack: bool = False  # time series stacked: parts that add up to a whole

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.title}: unknown panel kind {self.kind!r}")
        if self.stack and self.kind != TIMESERIES:
            raise ValueError(f"{self.title}: only time series stack")
        if not self.targets:
            raise ValueError(f"{self.title}: a panel needs at least one query")


@dataclass(frozen=True)
class Row:
    """A titled row of panels; panels flow left to right and wrap."""

    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Variable:
    """A dashboard template variable.

    A datasource variable when `query` is empty; otherwise a query variable listing the
    values of `label` on the series `query` selects (Grafana's label_values), multi-select
    with an All option that matches everything (".*"), so new loaders and ranks show.
    """

    name: str
    label: str
    query: str = ""

    @property
    def definition(self) -> str:
        return f"label_values({self.query}, {self.name})" if self.query else ""


@dataclass(frozen=True)
class Board:
    """A dashboard: identity, variables and rows of panels."""

    uid: str
    title: str
    description: str
    variables: tuple[Variable, ...]
    rows: tuple[Row, ...]
    tags: tuple[str, ...] = ("dataloader-exporter",)

    def panels(self) -> list[Panel]:
        return [p for row in self.rows for p in row.panels]


_NAME = re.compile(r"[A-Z][A-Za-z0-9]+")
_DURATION = re.compile(r"\d+[smh]")


@dataclass(frozen=True)
class Alert:
    """One alert, rendered both as a Grafana rule and as a Prometheus rule.

    `expr` has Prometheus semantics (every series it returns fires) and returns only
    positive values when it fires, the value saying by how much (a share, seconds, a
    count). That lets Grafana's rule be the same query followed by `last > 0`; the
    promtool cases check the invariant.
    """

    name: str  # CamelCase alertname, also the Grafana rule's title
    expr: str
    for_: str
    severity: str
    summary: str  # may use {{ $labels.<label> }}
    description: str  # what it means and the fix

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"alert name {self.name!r} is not CamelCase")
        if not _DURATION.fullmatch(self.for_):
            raise ValueError(f"{self.name}: bad duration {self.for_!r}")
        if self.severity not in (WARNING, CRITICAL):
            raise ValueError(f"{self.name}: bad severity {self.severity!r}")

    @property
    def uid(self) -> str:
        """A stable Grafana rule uid (Grafana allows at most 40 characters)."""
        return "-".join(w.lower() for w in re.findall(r"[A-Z][a-z0-9]*", self.name))[:40]

    def labels(self) -> dict[str, str]:
        """The labels the rule adds to every alert it fires."""
        return {"severity": self.severity}


@dataclass(frozen=True)
class Case:
    """A promtool unit test of one alert: input series, an evaluation time, and the
    labels of the alert expected to fire then (`fires`), or none (`fires` empty)."""

    alert: str
    name: str
    series: tuple[tuple[str, str], ...]  # (series selector, promtool values notation)
    eval_time: str
    fires: tuple[tuple[tuple[str, str], ...], ...] = ()  # label sets, without severity


# level:metric:operations, Prometheus's naming convention for recording rules.
_RECORD = re.compile(r"[a-z][a-z0-9_]*:[a-z][a-z0-9_]*:[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class Recording:
    """A recording rule: the series it records (level:metric:operations), its PromQL, and
    what it means. Rules of one group run in order, so a rule may use earlier ones."""

    record: str
    expr: str
    description: str

    def __post_init__(self) -> None:
        if not _RECORD.fullmatch(self.record):
            raise ValueError(f"recording rule {self.record!r} is not level:metric:operations")


@dataclass(frozen=True)
class RecordCase:
    """A promtool unit test of recording rules: input series, an evaluation time, and the
    samples expected then, each a series selector (record name and labels) and a value.
    Values are exact in binary (promtool compares floats exactly)."""

    name: str
    series: tuple[tuple[str, str], ...]  # (series selector, promtool values notation)
    eval_time: str
    samples: tuple[tuple[str, float], ...]
    absent: tuple[str, ...] = ()  # records that must have no sample then (unknown, not 0)
