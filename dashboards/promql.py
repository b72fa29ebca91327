"""PromQL built from the metric catalogue, shared by the dashboards and the alerts.

One function builds, say, the input stall share both for a panel (with the dashboard's
variables and ``$__rate_interval``) and for an alert (no variables, a fixed window), so
the two cannot drift apart. No metric name is typed here: they come from the catalogue.
"""

from __future__ import annotations

from dataloader_exporter.core import catalogue as cat

RATE_INTERVAL = "$__rate_interval"
# Matchers from the dashboard variables. Multi-select values (and All, which is ".*")
# arrive as regular expressions, hence =~.
HOST = 'job=~"$job",instance=~"$instance"'
LOADER = HOST + ',loader=~"$loader",rank=~"$rank"'
GPUS = HOST + ',gpu=~"$gpu"'

# Legends, in Grafana's {{label}} syntax.
BY_RANK = "{{loader}} rank {{rank}}"
BY_GPU = "{{instance}} GPU {{gpu}}"


def selector(name: str, matchers: str = "", **labels: str) -> str:
    """A series selector for any name (a recorded series, another exporter's metric)."""
    parts = [matchers] if matchers else []
    parts += [f'{k}="{v}"' for k, v in sorted(labels.items())]
    return f"{name}{{{','.join(parts)}}}" if parts else name


def sel(metric: cat.Metric, matchers: str = "", suffix: str = "", **labels: str) -> str:
    """A series selector: the catalogue name (plus _sum/_count/_bucket) and matchers."""
    return selector(metric.name + suffix, matchers, **labels)


def rate(selector: str, window: str) -> str:
    return f"rate({selector}[{window}])"


def _agg(by: str | None) -> str:
    """None: keep every series (drop only `phase`); "": one total; else sum by (labels)."""
    if by is None:
        return "sum without (phase)"
    return f"sum by ({by})" if by else "sum"


def fetch_wait_rate(matchers: str, window: str, by: str | None = None) -> str:
    """Seconds per second the training loop spent blocked waiting for batches."""
    fetch = rate(sel(cat.TIME, matchers, "_sum", phase=cat.PHASE_FETCH), window)
    return f"{_agg(by)} ({fetch})"


def stall_share(matchers: str, window: str, by: str | None = None) -> str:
    """Input stall share: fetch wait / (fetch wait + step time), 0 to 1.

    The share of the loop's wall time spent waiting for input; TensorFlow's profiler
    calls a step input-bound above 20% and highly input-bound above 50%.
    """
    fetch = fetch_wait_rate(matchers, window, by)
    step = f"{_agg(by)} ({rate(sel(cat.STEP, matchers, '_sum'), window)})"
    return f"{fetch} / ({fetch} + {step})"


def quantile(q: float, metric: cat.Metric, matchers: str, window: str, **labels: str) -> str:
    """The q-quantile of a histogram per series, from its buckets' rates; a series with
    no observation in the window, or with the +Inf bucket alone (the large-job setting),
    drops out instead of showing NaN."""
    buckets = rate(sel(metric, matchers, "_bucket", **labels), window)
    return f"(histogram_quantile({q}, {buckets}) >= 0)"


def mean(metric: cat.Metric, matchers: str, window: str, **labels: str) -> str:
    """The mean observation of a histogram over the window, per series."""
    total = rate(sel(metric, matchers, "_sum", **labels), window)
    count = rate(sel(metric, matchers, "_count", **labels), window)
    return f"{total} / {count}"


def ratio(numerator: cat.Metric, denominator: cat.Metric, matchers: str = "") -> str:
    """numerator / denominator, series by series (a zero denominator drops the series)."""
    return f"{sel(numerator, matchers)} / ({sel(denominator, matchers)} > 0)"


# --- the workers, as the trainer reads them from /proc ------------------------------------


def workers_by_state(matchers: str, window: str, by: str) -> str:
    """Workers in each state (running, waiting for a CPU, blocked): the workers' seconds
    per second in it, summed by `by` and state; together, the live workers."""
    return f"sum by ({by}, state) ({rate(sel(cat.WORKER_TIME, matchers), window)})"


def worker_state_share(state: str, matchers: str, window: str) -> str:
    """Per (loader, rank): the share of the workers' wall time spent in `state`, 0 to 1
    (absent where the trainer reads no /proc figures)."""
    part = f"sum without (state) ({rate(sel(cat.WORKER_TIME, matchers, state=state), window)})"
    whole = f"sum without (state) ({rate(sel(cat.WORKER_TIME, matchers), window)})"
    return f"{part} / ({whole} > 0)"


# --- the workers' private memory against the room the trainer has left -------------------
# How far ahead growth is projected: copy-on-read OOM-kills a run hours after its start, so
# hours of warning; a drift that would take days to fill the room is left alone.
GROWTH_HORIZON_S = 6 * 3600


def worker_memory(kind: str, matchers: str = "") -> str:
    """Per loader and rank: the workers' memory of one kind of cat.MEMORY_KINDS (summed
    over live workers; kind="available" is the room the trainer's container has left)."""
    return sel(cat.WORKER_MEMORY, matchers, kind=kind)


# --- across ranks -----------------------------------------------------------------------
# In synchronous data parallel the ranks of a job share one batch period: each step waits
# at its collective for the slowest rank. These build the job-level figures from raw
# series, for panels and alerts; dashboards.recording records the same from its rules.
JOB_KEYS = "namespace, job, loader"
RANK_KEYS = f"{JOB_KEYS}, rank"


def _per_rank(expr: str) -> str:
    return f"sum by ({RANK_KEYS}) ({expr})"


def _per_batch(seconds: str, matchers: str, window: str) -> str:
    """Each rank's seconds per batch of a time series (ranks without batches drop out)."""
    batches = _per_rank(rate(sel(cat.BATCHES, matchers), window))
    return f"({_per_rank(seconds)} / ({batches} > 0))"


def rank_fetch_per_batch(matchers: str, window: str) -> str:
    """Each rank's fetch wait per batch, seconds."""
    fetch = rate(sel(cat.TIME, matchers, "_sum", phase=cat.PHASE_FETCH), window)
    return _per_batch(fetch, matchers, window)


def rank_step_per_batch(matchers: str, window: str) -> str:
    """Each rank's step per batch, seconds: compute, and any wait for other ranks."""
    return _per_batch(rate(sel(cat.STEP, matchers, "_sum"), window), matchers, window)


def job_batch_period(matchers: str, window: str) -> str:
    """The job's batch period: the slowest rank's fetch wait plus step per batch."""
    return (f"max by ({JOB_KEYS}) ({rank_fetch_per_batch(matchers, window)} + "
            f"{rank_step_per_batch(matchers, window)})")


def job_stall_share(matchers: str, window: str) -> str:
    """The job's input stall share, 0 to 1: the worst rank's fetch wait per batch over
    the common batch period. A single process: fetch wait / (fetch wait + step)."""
    worst = f"max by ({JOB_KEYS}) ({rank_fetch_per_batch(matchers, window)})"
    return f"{worst} / ({job_batch_period(matchers, window)} > 0)"


def straggler_excess(matchers: str, window: str) -> str:
    """Per rank: its fetch wait per batch above the median rank's, as a share of the
    job's batch period, i.e. how much of every other rank's time goes to waiting for it."""
    fetch = rank_fetch_per_batch(matchers, window)
    median = f"quantile by ({JOB_KEYS}) (0.5, {fetch})"
    by = f"on ({JOB_KEYS}) group_left ()"
    return f"({fetch} - {by} {median}) / {by} ({job_batch_period(matchers, window)} > 0)"


def wait_for_ranks(matchers: str, window: str) -> str:
    """Per rank, an estimate of the seconds per batch its step spends waiting for other
    ranks: its step per batch minus the fastest rank's (the straggler's step is the
    shortest: it arrives last at the collective and waits for nobody)."""
    step = rank_step_per_batch(matchers, window)
    return f"{step} - on ({JOB_KEYS}) group_left () min by ({JOB_KEYS}) ({step})"
