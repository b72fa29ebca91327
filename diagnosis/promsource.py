"""A doctor window from Prometheus: increase() over a time range instead of two scrapes.

The window is one job's (several jobs matching is an error: --match picks one); its
length is the span the loaders' data covers in the range (a run younger than --range is
not divided by --range), and each rank's local ranks are the ranks its exporter instance
reports (one machine's, or one pod's), not the world size.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Any

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.diagnosis.signals import Labels, Series, Window

# Counters and histogram parts read as increases; everything else as latest values.
_INCREASE = [cat.TIME, cat.STEP, cat.BATCHES, cat.SAMPLES, cat.EPOCHS, cat.TRANSFER_BYTES,
             cat.WORKER_CPU, cat.WORKER_TIME, cat.WORKER_READ, cat.WORKER_MAJOR_FAULTS,
             cat.LOOP_CPU]
# (dataloader_info: its newest label set, _newest_info.)
_LATEST = [cat.FIRST_BATCH, cat.TIME, cat.WORKERS_CONFIGURED, cat.WORKERS_ACTIVE,
           cat.WORKERS_LOST, cat.FAILURES, cat.BATCH_BYTES, cat.SHM_SIZE,
           cat.SHM_USED, cat.SHM_FREE, cat.HOST_MEMORY_TOTAL, cat.HOST_MEMORY_AVAILABLE,
           cat.HOST_SWAP_USED, cat.CGROUP_MEMORY_LIMIT, cat.CGROUP_MEMORY_USAGE,
           cat.GPU_UTILIZATION, cat.WORKER_MEMORY, cat.WORKER_MAX_RSS,
           cat.WORKER_PRIVATE_GROWTH, cat.DATASET_OBJECTS, cat.TUNER_STABLE,
           cat.TUNER_CHANGES]


def _api(base: str, expr: str, timeout: float) -> list[dict[str, Any]]:
    url = f"{base.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=timeout) as r:
        data = json.loads(r.read().decode())
    if data.get("status") != "success":
        raise ValueError(f"Prometheus rejected {expr!r}: {data.get('error')}")
    return list(data["data"]["result"])


def _query(base: str, expr: str, timeout: float) -> list[tuple[Labels, float]]:
    out = []
    for item in _api(base, expr, timeout):
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
    _one_job(base, sel, rng, timeout)
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
            # The last value in the range: a run that ended inside it keeps its figures.
            last = f"last_over_time({name}{{{sel}}}[{rng}])"
            expr = f"{agg} by ({', '.join(labels)}) ({last})" if labels else f"{agg}({last})"
            for lab, v in _query(base, expr, timeout):
                latest[(name, lab)] = v
    latest.update(_newest_info(base, sel, rng, timeout))
    for lab, v in _query(base, f"sum(delta({cat.HOST_SWAP_USED.name}{{{sel}}}[{rng}]))",
                         timeout):
        change[(cat.HOST_SWAP_USED.name, lab)] = v
    growth = f"sum by ({', '.join(cat.WORKER_MEMORY.labels)}) " \
             f"(delta({cat.WORKER_MEMORY.name}{{{sel}}}[{rng}]))"
    for lab, v in _query(base, growth, timeout):
        change[(cat.WORKER_MEMORY.name, lab)] = v
    seconds = _span(base, sel, rng, timeout)
    return Window(min(range_seconds, seconds) if seconds else range_seconds, increase, latest,
                  change, local_ranks_of(_query(
                      base, f"count by (instance, rank) ({_batches(sel, rng)})", timeout)))


def _newest_info(base: str, sel: str, rng: str, timeout: float) -> Series:
    """dataloader_info per (loader, rank): the label set sampled last in the range. The
    trainer relabels it when a setting changes (the loader tuner's, or the GPU learned at
    the first to_device), and last_over_time would keep every label set the range saw."""
    newest: dict[tuple[str, str], tuple[float, Labels]] = {}
    for item in _api(base, f"{cat.INFO.name}{{{sel}}}[{rng}]", timeout):
        values = item.get("values") or []
        if not values:
            continue
        labels = {k: v for k, v in item["metric"].items() if k in cat.INFO_LABELS}
        key, at = (labels.get("loader", ""), labels.get("rank", "")), float(values[-1][0])
        if key not in newest or at > newest[key][0]:
            newest[key] = (at, tuple(sorted(labels.items())))
    return {(cat.INFO.name, labels): 1.0 for _, labels in newest.values()}


def _batches(sel: str, rng: str) -> str:
    """Every loader's batch counter seen in the range, ended runs included."""
    return f"last_over_time({cat.BATCHES.name}{{{sel}}}[{rng}])"


def _one_job(base: str, sel: str, rng: str, timeout: float) -> None:
    """Refuses a selection that spans several jobs (in the range, ended ones included):
    their ranks would be summed together."""
    found = _query(base, f"count by (namespace, job) ({_batches(sel, rng)})", timeout)
    if len(found) > 1:
        names = sorted(", ".join(f"{k}={v}" for k, v in labels) for labels, _ in found)
        raise ValueError(f"{len(found)} jobs match ({'; '.join(names)}): pick one with "
                         "--match, e.g. --match 'job=\"train\"'")


def _span(base: str, sel: str, rng: str, timeout: float) -> float | None:
    """Seconds the loaders' batch counters cover in the range: from their first sample to
    their last change, plus one scrape interval (what increase() extrapolates over)."""
    first = last = None
    steps: list[float] = []
    for item in _api(base, f"{cat.BATCHES.name}{{{sel}}}[{rng}]", timeout):
        points = [(float(t), float(v)) for t, v in item.get("values", [])]
        if len(points) < 2:
            continue
        steps.append((points[-1][0] - points[0][0]) / (len(points) - 1))
        changed = [t for (t, v), (_, before) in zip(points[1:], points, strict=False)
                   if v != before]
        first = points[0][0] if first is None else min(first, points[0][0])
        end = changed[-1] if changed else points[0][0]
        last = end if last is None else max(last, end)
    if first is None or last is None or not steps:
        return None
    return last - first + sum(steps) / len(steps)


def local_ranks_of(rows: list[tuple[Labels, float]]) -> dict[str, int]:
    """rank -> how many ranks its exporter instance (machine or pod) reports, from the
    rows of count by (instance, rank)."""
    instance_of: dict[str, set[str]] = {}
    for labels, _ in rows:
        d = dict(labels)
        instance_of.setdefault(d.get("instance", ""), set()).add(d.get("rank", ""))
    out: dict[str, int] = {}
    for ranks in instance_of.values():
        for rank in ranks:
            out[rank] = max(out.get(rank, 0), len(ranks))
    return out
