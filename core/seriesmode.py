"""Which series a trainer exports per (loader, rank): the setting $DATALOADER_EXPORTER_SERIES.

Standard library only. `full` (the default) exports every trainer metric of the catalogue
that was measured. `job`, for jobs of thousands of ranks, keeps the job-level truth
(stall, stragglers, failures, workers) in a stated small number of series: the fetch-wait,
step and first-batch histograms as their +Inf bucket, _count and _sum (means, no
quantiles), the batch, sample and epoch counters, the last batch's time, the workers
configured, active and lost, failures by cause, the info gauge, and the exit time (the
process's: one series per rank); no transfer, per-worker, /proc or tuner series. The
recording rules of dashboards/recording.py read nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping

from . import catalogue as cat
from .envnames import ENV_SERIES

FULL = "full"
JOB = "job"
SERIES_MODES: tuple[str, ...] = (FULL, JOB)

# The metrics the job setting keeps (a histogram: its +Inf bucket, _count and _sum).
JOB_METRICS: frozenset[str] = frozenset(m.name for m in (
    cat.TIME, cat.STEP, cat.FIRST_BATCH, cat.BATCHES, cat.SAMPLES, cat.EPOCHS, cat.LAST_BATCH,
    cat.EXITED, cat.WORKERS_CONFIGURED, cat.WORKERS_ACTIVE, cat.WORKERS_LOST, cat.FAILURES,
    cat.DATASET_OBJECTS, cat.INFO))
# dataloader_time_seconds' phases it keeps: the fetch wait, not the transfer.
JOB_PHASES: frozenset[str] = frozenset((cat.PHASE_FETCH,))


def series_mode(environ: Mapping[str, str]) -> tuple[str, str | None]:
    """The setting from the environment, and the complaint about a bad value (None when
    good): an unset or empty variable is FULL, a bad one FULL with its complaint."""
    raw = environ.get(ENV_SERIES, "").strip().lower()
    if not raw:
        return FULL, None
    if raw in SERIES_MODES:
        return raw, None
    return FULL, (f"{ENV_SERIES}={environ[ENV_SERIES]!r} is not one of "
                  f"{', '.join(SERIES_MODES)}: exporting the full set of series")
