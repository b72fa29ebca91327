"""Recording rules that aggregate across ranks, per job and loader, and their promtool tests.

A training job of many ranks exports one set of series per rank; a cluster-wide dashboard
that read them raw would fan out over every rank of every job. These rules record, every
evaluation, a handful of series per (namespace, job, loader) instead. `namespace` is there
in Kubernetes (the PodMonitor adds it) and simply absent elsewhere.

In synchronous data parallel every step waits for the slowest rank, so a job's input stall
is not the mean of its ranks' stall shares: it is the worst rank's fetch wait per batch
over the common batch period (fetch wait plus step, per batch). For a single process that
is fetch wait / (fetch wait + step), the per-rank share the overview dashboard shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dataloader_exporter.core import catalogue as cat

from .dcgm import GPU_UTIL, gpu_utilization_by_job
from .model import RecordCase, Recording
from .promql import sel, selector

GROUP = "dataloader-recording"
WINDOW = "5m"
RANK = "namespace, job, loader, rank"
JOB = "namespace, job, loader"
ON_JOB = f"on ({JOB}) group_left ()"  # each rank's series against its job's one

FETCH_RATE = "job_loader_rank:dataloader_fetch_wait_seconds:rate5m"
STEP_RATE = "job_loader_rank:dataloader_step_seconds:rate5m"
RANK_BATCHES = "job_loader_rank:dataloader_batches:rate5m"
RANK_FETCH_PER_BATCH = "job_loader_rank:dataloader_fetch_wait_seconds_per_batch:rate5m"
RANK_STEP_PER_BATCH = "job_loader_rank:dataloader_step_seconds_per_batch:rate5m"
FETCH_PER_BATCH = "job_loader:dataloader_fetch_wait_per_batch_seconds:max"
MEDIAN_FETCH_PER_BATCH = "job_loader:dataloader_fetch_wait_seconds_per_batch:median"
BATCH_PERIOD = "job_loader:dataloader_batch_period_seconds:max"
INPUT_STALL = "job_loader:dataloader_input_stall:ratio"
STRAGGLER = "job_loader_rank:dataloader_input_straggler:ratio"
WAIT_FOR_RANKS = "job_loader_rank:dataloader_wait_for_ranks_seconds_per_batch:step_minus_fastest"
SAMPLES = "job_loader:dataloader_samples:rate5m"
BATCHES = "job_loader:dataloader_batches:rate5m"
RANKS = "job_loader:dataloader_ranks:count"
WORKERS_LOST = "job_loader:dataloader_workers_lost:increase5m"
GPU = "job:gpu_utilization_ratio:avg"


def _rate(metric: cat.Metric, suffix: str = "", **labels: str) -> str:
    return f"rate({sel(metric, '', suffix, **labels)}[{WINDOW}])"


RULES: tuple[Recording, ...] = (
    Recording(FETCH_RATE,
              f"sum by ({RANK}) ({_rate(cat.TIME, '_sum', phase=cat.PHASE_FETCH)})",
              "Seconds per second each rank's loop waited for batches."),
    Recording(STEP_RATE, f"sum by ({RANK}) ({_rate(cat.STEP, '_sum')})",
              "Seconds per second each rank spent in the step, outside the loader."),
    Recording(RANK_BATCHES, f"sum by ({RANK}) ({_rate(cat.BATCHES)})",
              "Batches per second each rank handed to its loop."),
    # Ranks that handed out no batch in the window have no per-batch figures (0/0 is
    # unknown, not a value): they drop out here rather than record NaN.
    Recording(RANK_FETCH_PER_BATCH, f"{FETCH_RATE} / ({RANK_BATCHES} > 0)",
              "Each rank's fetch wait per batch."),
    Recording(RANK_STEP_PER_BATCH, f"{STEP_RATE} / ({RANK_BATCHES} > 0)",
              "Each rank's step per batch: compute, and any wait for other ranks."),
    Recording(FETCH_PER_BATCH, f"max by ({JOB}) ({RANK_FETCH_PER_BATCH})",
              "The worst rank's fetch wait per batch: the rank every other one waits for."),
    Recording(MEDIAN_FETCH_PER_BATCH, f"quantile by ({JOB}) (0.5, {RANK_FETCH_PER_BATCH})",
              "The median rank's fetch wait per batch (Prometheus's quantile: the mean of "
              "the middle two for an even count), what a straggler is measured against."),
    Recording(BATCH_PERIOD,
              f"max by ({JOB}) ({RANK_FETCH_PER_BATCH} + {RANK_STEP_PER_BATCH})",
              "Wall time per batch (fetch wait plus step), the slowest rank's; in "
              "synchronous data parallel the ranks share it."),
    Recording(INPUT_STALL, f"{FETCH_PER_BATCH} / ({BATCH_PERIOD} > 0)",
              "The job's input stall share: the worst rank's fetch wait per batch over the "
              "common batch period, 0 to 1."),
    Recording(STRAGGLER,
              f"({RANK_FETCH_PER_BATCH} - {ON_JOB} {MEDIAN_FETCH_PER_BATCH}) "
              f"/ {ON_JOB} ({BATCH_PERIOD} > 0)",
              "Each rank's fetch wait per batch above the median rank's, as a share of the "
              "batch period: how much of the other ranks' time goes to waiting for its "
              "input. At 0.05 and above it is an input straggler (DataLoaderInputStraggler)."),
    Recording(WAIT_FOR_RANKS,
              f"{RANK_STEP_PER_BATCH} - {ON_JOB} "
              f"min by ({JOB}) ({RANK_STEP_PER_BATCH})",
              "An estimate of each rank's step per batch spent waiting for other ranks in "
              "the collective: its step minus the fastest rank's. Not compute."),
    Recording(SAMPLES, f"sum by ({JOB}) ({_rate(cat.SAMPLES)})",
              "Samples per second the job's ranks hand to their loops, together."),
    Recording(BATCHES, f"sum by ({JOB}) ({RANK_BATCHES})",
              "Batches per second over all the job's ranks."),
    Recording(RANKS, f"count by ({JOB}) ({RANK_BATCHES})",
              "Ranks of the job whose loader reports."),
    Recording(WORKERS_LOST, f"sum by ({JOB}) (increase({sel(cat.WORKERS_LOST)}[{WINDOW}]))",
              "DataLoader worker processes the job lost in the window (crashed, killed)."),
    Recording(GPU, f"({gpu_utilization_by_job()}) or "
                   f"avg by (namespace, job) ({sel(cat.GPU_UTILIZATION)})",
              "Mean utilization of the job's GPUs, 0 to 1: dcgm-exporter's joined on the "
              "pod where present (Kubernetes), else the sidecar's NVML collector's."),
)
NAMES = tuple(r.record for r in RULES)


# --- promtool cases -------------------------------------------------------------------------
def _s(metric: cat.Metric | str, values: str, suffix: str = "", **labels: str
       ) -> tuple[str, str]:
    if isinstance(metric, str):
        return selector(metric, **labels), values
    return sel(metric, "", suffix, **labels), values


def _out(record: str, value: float, **labels: str) -> tuple[str, float]:
    return selector(record, **labels), value


def _rank(fetch: float, step: float, batches: float, labels: dict[str, str],
          samples: float = 0) -> tuple[tuple[str, str], ...]:
    """One rank's counters, growing by these amounts a minute (with an instance label the
    rules must drop)."""
    labels = {"instance": f"{labels.get('pod', 'trainer')}:9478", **labels}
    out = (_s(cat.TIME, f"0+{fetch}x10", "_sum", phase=cat.PHASE_FETCH, **labels),
           _s(cat.TIME, "0+1x10", "_sum", phase=cat.PHASE_TRANSFER, **labels),
           _s(cat.STEP, f"0+{step}x10", "_sum", **labels),
           _s(cat.BATCHES, f"0+{batches}x10", **labels))
    return out + ((_s(cat.SAMPLES, f"0+{samples}x10", **labels),) if samples else ())


ONE = {"job": "dataloader-exporter", "loader": "train"}
K8S = {"namespace": "team-a", "job": "llm", "loader": "train"}
EVAL = {**K8S, "job": "eval"}

CASES: tuple[RecordCase, ...] = (
    RecordCase(
        "a single process: the job's stall share is fetch wait / (fetch wait + step)",
        _rank(15, 45, 480, {"rank": "0", **ONE}, samples=15360), "10m",
        (_out(FETCH_RATE, 0.25, rank="0", **ONE), _out(STEP_RATE, 0.75, rank="0", **ONE),
         _out(RANK_BATCHES, 8, rank="0", **ONE), _out(FETCH_PER_BATCH, 0.03125, **ONE),
         _out(RANK_FETCH_PER_BATCH, 0.03125, rank="0", **ONE),
         _out(RANK_STEP_PER_BATCH, 0.09375, rank="0", **ONE),
         _out(MEDIAN_FETCH_PER_BATCH, 0.03125, **ONE), _out(STRAGGLER, 0, rank="0", **ONE),
         _out(WAIT_FOR_RANKS, 0, rank="0", **ONE),
         _out(BATCH_PERIOD, 0.125, **ONE), _out(INPUT_STALL, 0.25, **ONE),
         _out(SAMPLES, 256, **ONE), _out(BATCHES, 8, **ONE), _out(RANKS, 1, **ONE))),
    RecordCase(
        "two ranks in step: the worst rank's wait over the common period (0.5, not the "
        "mean 0.3125), per namespace, job and loader",
        _rank(7.5, 52.5, 480, {"rank": "0", "pod": "llm-0", **K8S})
        + _rank(30, 30, 480, {"rank": "1", "pod": "llm-1", **K8S})
        + _rank(0, 60, 480, {"rank": "0", "pod": "eval-0", **EVAL}), "10m",
        (_out(FETCH_PER_BATCH, 0.0625, **K8S), _out(FETCH_PER_BATCH, 0, **EVAL),
         _out(MEDIAN_FETCH_PER_BATCH, 0.0390625, **K8S),
         _out(MEDIAN_FETCH_PER_BATCH, 0, **EVAL),
         _out(STRAGGLER, -0.1875, rank="0", **K8S), _out(STRAGGLER, 0.1875, rank="1", **K8S),
         _out(STRAGGLER, 0, rank="0", **EVAL),
         # 0.046875 (7/64 - 1/16), as rate()'s extrapolation leaves it in floating point
         _out(WAIT_FOR_RANKS, 0.046875000000000014, rank="0", **K8S),
         _out(WAIT_FOR_RANKS, 0, rank="1", **K8S), _out(WAIT_FOR_RANKS, 0, rank="0", **EVAL),
         _out(BATCH_PERIOD, 0.125, **K8S), _out(BATCH_PERIOD, 0.125, **EVAL),
         _out(INPUT_STALL, 0.5, **K8S), _out(INPUT_STALL, 0, **EVAL),
         _out(BATCHES, 16, **K8S), _out(BATCHES, 8, **EVAL),
         _out(RANKS, 2, **K8S), _out(RANKS, 1, **EVAL))),
    RecordCase(
        "eight ranks, one slow: rank 5 holds every rank back by half the batch period, and "
        "the others' step is half waiting for it (estimated against the fastest step)",
        tuple(x for r in range(8) for x in _rank(
            32 if r == 5 else 0, 32 if r == 5 else 64, 512,
            {"rank": str(r), "pod": f"llm-{r}", **K8S})), "10m",
        (_out(MEDIAN_FETCH_PER_BATCH, 0, **K8S), _out(INPUT_STALL, 0.5, **K8S),
         *(_out(STRAGGLER, 0.5 if r == 5 else 0, rank=str(r), **K8S) for r in range(8)),
         *(_out(WAIT_FOR_RANKS, 0 if r == 5 else 0.0625, rank=str(r), **K8S)
           for r in range(8)))),
    RecordCase(
        "an idle loader (no batch in the window, an evaluation loader between passes) has "
        "no per-batch figures and no stall share: unknown, never NaN",
        _rank(0, 0, 0, {"rank": "0", "pod": "eval-0", **EVAL}), "10m",
        (_out(BATCHES, 0, **EVAL), _out(RANKS, 1, **EVAL)),
        absent=(RANK_FETCH_PER_BATCH, RANK_STEP_PER_BATCH, FETCH_PER_BATCH,
                MEDIAN_FETCH_PER_BATCH, BATCH_PERIOD, INPUT_STALL, STRAGGLER, WAIT_FOR_RANKS)),
    RecordCase(
        "lost workers per job and loader",
        (_s(cat.WORKERS_LOST, "0+1x10", instance="llm-0:9478", pod="llm-0", rank="0", **K8S),
         _s(cat.WORKERS_LOST, "0x10", instance="llm-1:9478", pod="llm-1", rank="1", **K8S)),
        "10m", (_out(WORKERS_LOST, 5, **K8S),)),
    RecordCase(
        "GPU utilization per job from dcgm-exporter, joined on the pods of the job",
        (_s(GPU_UTIL, "75x10", namespace="team-a", pod="llm-0", container="trainer",
            gpu="0", job="dcgm-exporter"),
         _s(GPU_UTIL, "25x10", namespace="team-a", pod="llm-1", container="trainer",
            gpu="0", job="dcgm-exporter"),
         _s(GPU_UTIL, "100x10", namespace="team-b", pod="other", container="x", gpu="1",
            job="dcgm-exporter"),
         _s(cat.BATCHES, "0+60x10", instance="llm-0:9478", pod="llm-0", rank="0", **K8S),
         _s(cat.BATCHES, "0+60x10", instance="llm-1:9478", pod="llm-1", rank="1", **K8S)),
        "10m", (_out(GPU, 0.5, namespace="team-a", job="llm"),)),
    RecordCase(
        "GPU utilization per job from the sidecar's NVML collector without dcgm-exporter",
        (_s(cat.GPU_UTILIZATION, "0.75x10", job="dataloader-exporter", instance="h:9478",
            gpu="0", gpu_uuid="GPU-0"),
         _s(cat.GPU_UTILIZATION, "0.25x10", job="dataloader-exporter", instance="h:9478",
            gpu="1", gpu_uuid="GPU-1")),
        "10m", (_out(GPU, 0.5, job="dataloader-exporter"),)),
)


# --- rendering --------------------------------------------------------------------------------
def recording_rules(rules: Sequence[Recording] = RULES) -> dict[str, Any]:
    """A Prometheus rule file with one group of recording rules, in evaluation order."""
    return {"groups": [{"name": GROUP,
                        "rules": [{"record": r.record, "expr": r.expr} for r in rules]}]}


def promtool_tests(cases: Sequence[RecordCase] = CASES,
                   rule_file: str = "recording.yml") -> dict[str, Any]:
    """A `promtool test rules` file: each case checks the recorded samples at its time."""
    tests = []
    for case in cases:
        by_record: dict[str, list[dict[str, Any]]] = {}
        for series, value in case.samples:
            by_record.setdefault(series.split("{")[0], []).append(
                {"labels": series, "value": value})
        tests.append({
            "name": case.name, "interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in case.series],
            "promql_expr_test": [{"expr": record, "eval_time": case.eval_time,
                                  "exp_samples": samples}
                                 for record, samples in by_record.items()] +
                                [{"expr": record, "eval_time": case.eval_time,
                                  "exp_samples": []} for record in case.absent],
        })
    return {"rule_files": [rule_file], "evaluation_interval": "1m", "tests": tests}
