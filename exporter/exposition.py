"""Fast encoders for the Prometheus text format (0.0.4) and OpenMetrics 1.0.

prometheus_client's encoders validate and escape every label name of every sample, most
of a scrape's time (docs/design/exporter.md). These produce the same output (tests
compare both against prometheus_client's) for the families this exporter yields
(counters, gauges, histograms; legacy names; label values escaped only when they need
it); any other family a user's registry holds is written by prometheus_client itself.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any, cast

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric as Family
from prometheus_client.openmetrics.exposition import generate_latest as om_generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
_NEEDS_ESCAPE = re.compile(r'[\\"\n]')
_FAST_TYPES = frozenset({"counter", "gauge", "histogram"})
_EOF = "# EOF\n"


def _escape_value(v: str) -> str:
    if _NEEDS_ESCAPE.search(v) is None:
        return v
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def float_text(d: float) -> str:
    """Go's float formatting, as prometheus_client's floatToGoString writes it."""
    if d == math.inf:
        return "+Inf"
    if d == -math.inf:
        return "-Inf"
    if d != d:
        return "NaN"
    s = repr(float(d))
    dot = s.find(".")
    if d > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


def _labels(labels: dict[str, str], cache: dict[tuple[tuple[str, str], ...], str]) -> str:
    if not labels:
        return ""
    key = tuple(sorted(labels.items()))
    text = cache.get(key)
    if text is None:
        text = cache[key] = "{" + ",".join(f'{k}="{_escape_value(v)}"' for k, v in key) + "}"
    return text


class EncodedFamily(Family):
    """A counter, gauge or histogram whose sample lines are written already (the same
    lines in both formats), as chunks of text. Its samples are parsed back only if
    something asks for them (a test's get_sample_value): scrapes never do."""

    def __init__(self, name: str, documentation: str, typ: str, chunks: list[str]) -> None:
        self.chunks = chunks
        self._parsed: list[Sample] | None = None
        super().__init__(name, documentation, typ)

    @property
    def samples(self) -> list[Sample]:
        if self._parsed is None:
            suffix = "_total" if self.type == "counter" else ""
            text = f"# TYPE {self.name}{suffix} {self.type}\n" + "".join(self.chunks)
            self._parsed = [s for f in text_string_to_metric_families(text) for s in f.samples]
        return self._parsed

    @samples.setter
    def samples(self, value: list[Sample]) -> None:
        if value:
            raise AttributeError("an EncodedFamily's samples are its chunks")


class _One:
    """A registry-like holder of one family, for prometheus_client's encoders."""

    def __init__(self, family: Family) -> None:
        self.family = family

    def collect(self) -> list[Family]:
        return [self.family]


def _fast(metric: Family) -> bool:
    """Whether our encoders write this family (ours always; a user's registry may hold
    others: info, stateset, summaries, units, exemplars go to prometheus_client's)."""
    if metric.type not in _FAST_TYPES or metric.unit:
        return False
    return all(s.exemplar is None and getattr(s, "native_histogram", None) is None
               for s in metric.samples)


def text(families: Iterable[Family]) -> bytes:
    """The Prometheus text format, as prometheus_client.generate_latest writes it."""
    out: list[str] = []
    cache: dict[tuple[tuple[str, str], ...], str] = {}
    for metric in families:
        encoded = isinstance(metric, EncodedFamily)
        if not encoded and not _fast(metric):
            out.append(generate_latest(_One(metric)).decode("utf-8"))
            continue
        name, mtype = metric.name, metric.type
        if mtype == "counter":
            name += "_total"
        doc = metric.documentation.replace("\\", "\\\\").replace("\n", "\\n")
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {mtype}\n")
        if encoded:
            out.extend(cast(EncodedFamily, metric).chunks)
            continue
        created: list[str] = []
        for s in metric.samples:
            line = _sample(s.name, s.labels, s.value, s.timestamp, cache, 1000)
            if s.name == metric.name + "_created":
                created.append(line)
            else:
                out.append(line)
        if created:
            out.append(f"# HELP {metric.name}_created {doc}\n"
                       f"# TYPE {metric.name}_created gauge\n")
            out.extend(created)
    return "".join(out).encode("utf-8")


def _sample(name: str, labels: dict[str, str], value: float, timestamp: Any,
            cache: dict[tuple[tuple[str, str], ...], str], ts_scale: int) -> str:
    ts = ""
    if timestamp is not None:
        ts = (f" {int(float(timestamp) * 1000):d}" if ts_scale == 1000
              else f" {float_text(float(timestamp))}")
    return f"{name}{_labels(labels, cache)} {float_text(value)}{ts}\n"


def openmetrics(families: Iterable[Family]) -> bytes:
    """OpenMetrics 1.0, as prometheus_client.openmetrics.exposition writes it."""
    out: list[str] = []
    cache: dict[tuple[tuple[str, str], ...], str] = {}
    for metric in families:
        encoded = isinstance(metric, EncodedFamily)
        if not encoded and not _fast(metric):
            body = om_generate_latest(_One(metric)).decode("utf-8")
            out.append(body[: -len(_EOF)])
            continue
        mname = metric.name
        doc = metric.documentation.replace("\\", "\\\\").replace("\n", "\\n").replace(
            '"', '\\"')
        out.append(f"# HELP {mname} {doc}\n# TYPE {mname} {metric.type}\n")
        if encoded:
            out.extend(cast(EncodedFamily, metric).chunks)
            continue
        for s in metric.samples:
            out.append(_sample(s.name, s.labels, s.value, s.timestamp, cache, 1))
    out.append(_EOF)
    return "".join(out).encode("utf-8")
