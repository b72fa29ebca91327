"""How the tuner judges a trial under noise. Pure.

The noise is what repeated windows of one setting measured: half their range over their
mean, the largest over the settings seen twice or more. A trial is judged on the mean of
its windows against the best setting's rate, with a bar of twice the noise (at least
MIN_GAIN):

- more (workers, queue): kept when at least the bar faster; otherwise measured again (up
  to RETRIES more windows: one bad window on a busy machine does not rule a direction
  out), then kept when its windows' mean is still MIN_GAIN faster (faster, if within the
  noise: never slower), else undone. A loader's first workers, which the model predicts
  faster past the bar (trusted), get one window more and are kept then unless their mean
  is slower at all: on a busy machine the prediction outweighs a few noisy windows that
  find them faster but not by the bar, never windows whose mean finds them slower (fed
  with figures measured without workers, the model cannot see what moving each batch
  from a worker costs);
- fewer: kept when no more than MIN_GAIN slower (the same speed with fewer workers is a
  gain in itself); undone when more than the bar slower; in between, measured again.

Once settled, a setting is left only when its rate falls DRIFT below the settled one,
for DRIFT_WINDOWS windows running, while the loop waits for input: a higher bar to leave a
setting than to take one, so noise does not make it oscillate.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

MIN_GAIN = 0.05  # the smallest change in samples/s a trial is judged on
MAX_BAR = 0.25  # however noisy, a trial 25% faster is kept
RETRIES = 1  # more windows for a trial whose result is within the noise
RETRIES_TRUSTED = 2  # for a trusted trial (the module docstring)
DRIFT = 0.2  # a settled setting's rate falling this share below its own: tune again
DRIFT_WINDOWS = 2  # windows running that must show the drift

Verdict = Literal["keep", "undo", "again"]


@dataclass
class Judge:
    """Rates seen per setting, and the trial now running."""

    seen: dict[object, list[float]] = field(default_factory=lambda: defaultdict(list))
    trial: list[float] = field(default_factory=list)
    drifting: int = 0

    def saw(self, setting: object, rate: float) -> None:
        self.seen[setting].append(rate)

    def noise(self) -> float:
        """Half the range over the mean of one setting's windows, the largest seen."""
        worst = 0.0
        for rates in self.seen.values():
            if len(rates) >= 2 and sum(rates) > 0:
                worst = max(worst, (max(rates) - min(rates)) / (max(rates) + min(rates)))
        return worst

    def bar(self) -> float:
        return min(MAX_BAR, max(MIN_GAIN, 2 * self.noise()))

    def verdict(self, rate: float, best: float, more: bool,
                trusted: bool = False) -> tuple[Verdict, float]:
        """The trial's verdict after one more window at `rate`, and the rate judged (the
        mean of the trial's windows); trusted: a trial of more the model predicts faster
        past the bar (module docstring)."""
        self.trial.append(rate)
        mean = statistics.fmean(self.trial)
        if best <= 0:
            return "keep", mean
        gain, bar = mean / best - 1, self.bar()
        if more:
            verdict: Verdict = "keep" if gain >= bar else "again"
        else:
            verdict = ("keep" if gain >= -MIN_GAIN else "undo" if gain < -bar else "again")
        if verdict == "again" and len(self.trial) > (RETRIES_TRUSTED if more and trusted
                                                     else RETRIES):
            floor = (0.0 if trusted else MIN_GAIN) if more else -bar
            verdict = "keep" if gain >= floor else "undo"
        if verdict != "again":
            self.trial = []
        return verdict, mean

    def drifted(self, rate: float, settled: float, waiting: bool, times: int = 1) -> bool:
        """Whether a settled setting's rate has fallen DRIFT below `settled` for
        DRIFT_WINDOWS (x `times`) windows running while the loop waits for input."""
        if waiting and settled > 0 and rate < settled * (1 - DRIFT):
            self.drifting += 1
        else:
            self.drifting = 0
        return self.drifting >= DRIFT_WINDOWS * times
