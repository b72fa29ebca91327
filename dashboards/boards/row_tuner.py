"""The overview's row on the loader tuner (opt-in: ``auto`` in DATALOADER_EXPORTER_SETTINGS
or ``tune=``): which loaders it tunes and whether each is still trying or stable, what it
changed and why, and the workers it set. A loader that is not tuned has no series here
(dataloader_tuner_stable is absent for it), so the row is empty without the tuner."""

from __future__ import annotations

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.core.tuner.judge import MIN_GAIN

from ..model import BARGAUGE, COUNT, Panel, Row
from ..promql import BY_RANK, LOADER, sel

_WHY = ("starved (the loop waited on busy workers: more), cpu-contention (the workers "
        "waited for a CPU: fewer), cores (more workers than this rank's cores), memory "
        "(memory would not hold them), bursty (the wait came in bursts: a deeper "
        f"prefetch_factor), reverted (a trial did not pay: more was not {MIN_GAIN:.0%} "
        f"faster, or fewer was over {MIN_GAIN:.0%} slower; back to the best setting)")

TUNER = Row("The loader tuner", (
    Panel("Loader tuner stable",
          "Per tuned loader and rank: Yes once the loader tuner has settled on num_workers "
          "and prefetch_factor, No while it still tries changes between epochs (a few "
          "epochs; the doctor holds its own advice on those two settings meanwhile). A "
          "loader that is not tuned has no bar. Good: Yes after the first epochs. Settled, "
          "the tuner logs the DATALOADER_EXPORTER_SETTINGS line that keeps its settings "
          "without tuning.",
          "bool_yes_no", ((BY_RANK, f"max by (loader, rank) ({sel(cat.TUNER_STABLE, LOADER)})"),),
          BARGAUGE, ((None, "blue"), (1, "green")), 0, 1),
    Panel("Loader tuner changes by setting and reason",
          "The changes the loader tuner made since each trainer started, summed over the "
          "selected ranks, by setting (num_workers, prefetch_factor) and reason: " + _WHY +
          ". Good: a few, then none (it stops after its trials). Many reverted: more of "
          "that setting did not help; the input is bound elsewhere (storage, CPU per sample).",
          COUNT, (("{{loader}} {{setting}} {{reason}}",
                   f"sum by (loader, setting, reason) ({sel(cat.TUNER_CHANGES, LOADER)})"),),
          BARGAUGE),
    Panel("Tuned loaders: num_workers and changes",
          "num_workers of each tuned loader over time, and the tuner's changes so far by "
          "setting and reason: each change is a step in both, so it lines up with its "
          "effect on Input stall share and throughput (each setting and reason the tuner can "
          "change it for starts at 0). Good: a few steps early "
          "on, then flat. prefetch_factor is in dataloader_info (and in the doctor's report).",
          COUNT, ((f"num_workers {BY_RANK}",
                   f"{sel(cat.WORKERS_CONFIGURED, LOADER)} and on (loader, rank) "
                   f"{sel(cat.TUNER_STABLE, LOADER)}"),
                  (f"{BY_RANK} {{{{setting}}}} {{{{reason}}}}",
                   f"sum by (loader, rank, setting, reason) "
                   f"({sel(cat.TUNER_CHANGES, LOADER)})"))),
))
