"""A doctor window from Prometheus: increase() over a time range instead of two scrapes."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request

from diagnosis.signals import Labels, Series, Window
from exporter import catalogue as cat

# Counters and histogram parts read as increases; everything else as latest values.
_INCREASE = [cat.TIME, cat.STEP, cat.BATCHES, cat.SAMPLES, cat.EPOCHS, cat.TRANSFER_BYTES,
             cat.WORKER_CPU]
_LATEST = [cat.FIRST_BATCH, cat.TIME, cat.WORKERS_CONFIGURED, cat.WORKERS_ACTIVE,
           cat.WORKERS_LOST, cat.BATCH_BYTES, cat.INFO, cat.SHM_SIZE, cat.SHM_USED,
           cat.SHM_FREE, cat.HOST_MEMORY_TOTAL, cat.HOST_MEMORY_AVAILABLE, cat.HOST_SWAP_USED,
           cat.GPU_UTILIZATION]


def _query(base: str, expr: str, timeout: float) -> list[tuple[Labels, float]]:
    url = f"{base.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=timeout) as r:
        data = json.loads(r.read().decode())
    if data.get("status") != "success":
        raise ValueError(f"Prometheus rejected {expr!r}: {data.get('error')}")
    out = []
    for item in data["data"]["result"]:
        labels = tuple(sorted(item["metric"].items()))
        out.append((labels, float(item["value"][1])))
    return out


def _parts(metric: cat.Metric) -> list[tuple[str, tuple[str, ...]]]:
    if metric.type == cat.HISTOGRAM:
        return [(metric.name + "_sum", metric.labels), (metric.name + "_count", metric.labels),
                (metric.name + "_bucket", (*metric.labels, "le"))]
    return [(metric.name, metric.labels)]


def window(base: str, range_seconds: float, match: str = "", timeout: float = 10.0) -> Window:
    """Increases over the last `range_seconds` and latest values, summed by catalogue labels."""
    rng = f"{int(range_seconds)}s"
    sel = match.strip().strip("{}")
    increase: Series = {}
    latest: Series = {}
    change: Series = {}
    for metric in _INCREASE:
        for name, labels in _parts(metric):
            by = ", ".join(labels)
            expr = f"sum by ({by}) (increase({name}{{{sel}}}[{rng}]))"
            for lab, v in _query(base, expr, timeout):
                increase[(name, lab)] = v
    for metric in _LATEST:
        for name, labels in _parts(metric):
            agg = "max" if metric.type == cat.GAUGE else "sum"
            expr = f"{agg} by ({', '.join(labels)}) ({name}{{{sel}}})" if labels else (
                f"{agg}({name}{{{sel}}})")
            for lab, v in _query(base, expr, timeout):
                latest[(name, lab)] = v
    for lab, v in _query(base, f"sum(delta({cat.HOST_SWAP_USED.name}{{{sel}}}[{rng}]))",
                         timeout):
        change[(cat.HOST_SWAP_USED.name, lab)] = v
    return Window(range_seconds, increase, latest, change)
