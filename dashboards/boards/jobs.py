"""The "DataLoader jobs" dashboard: every training job of the cluster at a glance.

It reads only the recording rules' series (dashboards.recording), a handful per job and
loader, so it stays fast with thousands of ranks; open the DataLoader overview for one
job's ranks, workers and memory.
"""

from __future__ import annotations

from dataloader_exporter.core import bands

from .. import recording as r
from ..model import BARGAUGE, COUNT, RATIO, SECONDS, Board, Panel, Row, Step, Variable

JOBS = 'namespace=~"$namespace",job=~"$job",loader=~"$loader"'
BY_JOB = "{{namespace}} {{job}} {{loader}}"
STALL_BANDS: tuple[Step, ...] = ((None, "green"), (bands.MODERATE, "yellow"),
                                  (bands.INPUT_BOUND, "red"))
GPU_BANDS: tuple[Step, ...] = ((None, "red"), (bands.GPU_IDLE, "yellow"),
                                (bands.GPU_BUSY, "green"))
WINDOW_NOTE = " Recorded over 5-minute windows by Prometheus's recording rules."


def rec(name: str, matchers: str = JOBS) -> str:
    return f"{name}{{{matchers}}}"


glance = Row("Which jobs starve?", (
    Panel("Input stall share by job",
          "Each job's input stall share now: the worst rank's fetch wait per batch over the "
          "common batch period (in synchronous data parallel every rank waits for the "
          f"slowest). Good: under {bands.MODERATE:.0%}. Over {bands.INPUT_BOUND:.0%} the job is "
          "input-bound: open the DataLoader "
          "overview for that job to see which rank and why." + WINDOW_NOTE,
          RATIO, ((BY_JOB, rec(r.INPUT_STALL)),), BARGAUGE, STALL_BANDS, 0, 1),
    Panel("Input stragglers",
          "The ten ranks, over the selected jobs, whose input holds their job back most: "
          "each one's fetch wait per batch above its job's median rank's, as a share of the "
          "batch period (that much of every other rank's time goes to waiting for it). "
          "Reads the same with 2 or 64 ranks a job. Good: every bar under "
          f"{bands.MODERATE:.0%}; from {bands.MODERATE:.0%} "
          "(red) the rank is an input straggler and DataLoaderInputStraggler fires after "
          "10 minutes. Fix that rank's input (its host's storage, cores, /dev/shm), not "
          "the others'." + WINDOW_NOTE,
          RATIO, (("{{namespace}} {{job}} {{loader}} rank {{rank}}",
                   f"topk(10, {rec(r.STRAGGLER)})"),), BARGAUGE,
          ((None, "green"), (bands.STRAGGLER, "red")), 0, 1),
    Panel("GPU utilization by job",
          "Mean utilization of each job's GPUs now: dcgm-exporter's, joined on the pods "
          f"(Kubernetes), or the sidecar's NVML collector's. Good: over {bands.GPU_BUSY:.0%} "
          "while training. "
          "Low with a high input stall share: the GPUs wait for data.",
          RATIO, (("{{namespace}} {{job}}",
                   rec(r.GPU, 'namespace=~"$namespace",job=~"$job"')),),
          BARGAUGE, GPU_BANDS, 0, 1),
))

trends = Row("Over time", (
    Panel("Input stall share",
          f"Each job's input stall share over time. Good: flat and under {bands.MODERATE:.0%}. "
          "Spikes at "
          "regular intervals are epoch starts (persistent_workers=True) or evaluation." +
          WINDOW_NOTE,
          RATIO, ((BY_JOB, rec(r.INPUT_STALL)),), thresholds=STALL_BANDS, max=1),
    Panel("Worst rank's fetch wait against the batch period",
          "Per job and loader: the slowest rank's wait for a batch, and the wall time of a "
          "batch (fetch wait plus step). Good: the wait a small part of the period. The "
          "wait close to the period means the step waits on input.",
          SECONDS, ((f"wait {BY_JOB}", rec(r.FETCH_PER_BATCH)),
                    (f"period {BY_JOB}", rec(r.BATCH_PERIOD)))),
    Panel("Samples per second",
          "Samples each job's ranks hand to their loops per second, together. Good: steady. "
          "A drop with a rising stall share is the input pipeline (storage, CPU).",
          COUNT, ((BY_JOB, rec(r.SAMPLES)),)),
    Panel("Ranks reporting and workers lost",
          "Ranks whose loader reports, and DataLoader workers lost in the last 5 minutes. "
          "Good: ranks constant for the job's life, no workers lost. Lost workers are "
          "usually the OOM killer or a full /dev/shm.",
          COUNT, ((f"ranks {BY_JOB}", rec(r.RANKS)),
                  (f"workers lost {BY_JOB}", rec(r.WORKERS_LOST)))),
))

JOBS_BOARD = Board(
    uid="dataloader-jobs",
    title="DataLoader jobs",
    description="Every training job's input stall, throughput and GPU utilization, from "
                "the recording rules that aggregate across ranks.",
    variables=(
        Variable("datasource", "Data source"),
        Variable("namespace", "Namespace", r.RANKS),
        Variable("job", "Job", rec(r.RANKS, 'namespace=~"$namespace"')),
        Variable("loader", "Loader", rec(r.RANKS, 'namespace=~"$namespace",job=~"$job"')),
    ),
    rows=(glance, trends),
)
