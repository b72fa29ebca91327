"""The tuner's windows mid-epoch, for a loader whose pool can change there without
changing what the loop sees (LoaderTuning.midepoch): every WINDOW seconds in the loop the
window since the last mark is judged, and a change is left pending for the loop to make
at its next reading (tuner_switch.py). A settled loader's windows are still judged, for
drift (core/tuner_judge.py). A new pool's first batches only start the next
window: its start is its own figure, not its steady rate.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from dataloader_exporter.core.settings import log_name
from dataloader_exporter.core.tuner_judge import DRIFT
from dataloader_exporter.core.tuner_rules import Tuner
from dataloader_exporter.core.tuner_types import Decision, Setting

from .hotpath_recorder import LoaderRecorder
from .tuner_budget import budget
from .tuner_epoch import MIN_BATCHES, Mark, epoch_since, paused, take_mark

log = logging.getLogger("dataloader_exporter.instrument")

WINDOW = 3.0  # seconds: a window judged mid-epoch


def say_failed(name: str, now: int, back: int, error: Exception, epoch: str) -> None:
    """Logs that the tuner's new workers failed (num_workers now -> back), with the last
    line of torch's worker traceback, and what the epoch does (`epoch`) without them."""
    lines = str(error).strip().splitlines()
    said = lines[-1] if lines else ""  # torch's worker traceback ends with the error
    kind = type(error).__name__
    said = said[len(kind) + 2:] if said.startswith(f"{kind}: ") else said
    log.warning("dataloader %r: num_workers %d -> %d: its workers failed (%s: %s); the epoch "
                "%s without them and the tuner adds none", log_name(name), now, back, kind,
                said[:200], epoch)


class MidEpoch:
    """LoaderTuning's mid-epoch part; it holds what the methods below use."""

    name: str
    rec: LoaderRecorder
    tuner: Tuner
    midepoch: bool
    pending: Decision | None
    _lock: threading.RLock
    _mark: Mark | None
    _warming: bool
    _window_at_iter: bool
    _said_stable: bool

    def _say_stable(self) -> None:
        raise NotImplementedError

    def _count(self, setting: str, reason: str) -> None:
        raise NotImplementedError

    def _drifted(self) -> None:  # a settled rate drifted well below its own: tune again
        self._said_stable = False
        self.rec.tuner_stable = False
        if self.tuner.retuned == "doubt":
            log.warning("dataloader %r: the model asks for more workers than it settled at, "
                        "window after window, while the loop waits for input: the tuner tries "
                        "again", log_name(self.name))
            return
        log.warning("dataloader %r: samples/s fell %.0f%% below the rate it settled at while "
                    "the loop waits for input: the tuner tries again", log_name(self.name),
                    100 * DRIFT)

    def _partial(self, mark: Mark) -> bool:
        """Whether the window since `mark` is an epoch's tail after a mid-epoch window,
        shorter than WINDOW: too short to judge, its batches go to no window."""
        return (not self._window_at_iter
                and (self.rec.last_batch_ns - mark.t_ns) / 1e9 < WINDOW)

    def _window(self, mark: Mark, now: int) -> None:
        """A window of WINDOW seconds (or, for a new pool, its first batches) has passed
        in the loop: judged, and its change left pending for the loop (tuner_switch.py)."""
        warming = self._warming
        if (now - mark.t_ns) / 1e9 < (0.0 if warming else WINDOW):
            return
        if self.rec.batches - mark.batches < MIN_BATCHES:
            return
        with self._lock:
            if self._mark is not mark or self.pending is not None or (
                    self.tuner.stable and not self.rec.tuner_stable):
                return
            self._warming = False
            if not warming and not paused(self.rec, mark, WINDOW):
                epoch = epoch_since(self.rec, mark, self.name, flush=False, end_ns=now)
                if epoch is None:
                    return
                settled = self.tuner.stable  # watched: tuned again if its rate drifts
                self.pending = self.tuner.observe(epoch, budget())
                if settled and not self.tuner.stable:
                    self._drifted()
                self._say_stable()
            self._mark = take_mark(self.rec, None, flush=False, setting=self.tuner.current,
                                   mid=True)
            self._window_at_iter = False

    def no_switch(self) -> None:
        """The pending change cannot be made mid-epoch (torch's iterator lacks what it
        needs): it is made at the next iter(), and no more windows are judged mid-epoch."""
        self.midepoch = False
        log.info("dataloader %r: the tuner cannot change its pool mid-epoch; it changes it "
                 "between epochs", log_name(self.name))

    def switch(self, loader: Any, decision: Decision) -> None:
        """Sets the pending change on `loader` mid-epoch, its old pool ended (both
        settings or neither)."""
        with self._lock:
            before = loader.num_workers, loader.prefetch_factor
            s = decision.setting
            try:
                loader.prefetch_factor = s.prefetch if s.workers else None
                loader.num_workers = s.workers
            except BaseException:
                for attr, value in zip(("num_workers", "prefetch_factor"), before,
                                       strict=True):
                    with contextlib.suppress(Exception):
                        if getattr(loader, attr) != value:
                            setattr(loader, attr, value)
                raise
            self._count(decision.name, decision.reason)
            log.warning("%s (mid-epoch)", decision.line(log_name(self.name)))

    def cannot_switch(self, loader: Any, previous: Setting, error: Exception) -> bool:
        """A mid-epoch change from no workers failed to start its pool or its first batch:
        back to `previous`, no more workers; False when the settings cannot be put back."""
        now = loader.num_workers
        try:
            with self._lock:
                loader.num_workers = previous.workers
                loader.prefetch_factor = None if not previous.workers else previous.prefetch
                self.tuner.cannot_run(previous)
                self._count("num_workers", "reverted")
        except Exception:
            log.warning("dataloader %r: the tuner cannot undo its change",
                        log_name(self.name), exc_info=True)
            return False
        say_failed(self.name, now, previous.workers, error, "goes on")
        self._said_stable = False
        self._say_stable()
        return True
