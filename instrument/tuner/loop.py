"""The loader tuner at work: core/tuner/rules.py decides, this measures and applies.

A loader is tuned only when asked: ``auto`` in $DATALOADER_EXPORTER_SETTINGS
(``train.num_workers=auto``) or ``tune=`` on instrument.DataLoader. At each iter() the
epoch that ran since the previous iter() (epoch.py) is judged against this rank's
budget, read each time (budget.py).

A change is applied only between iterators, before torch's __iter__ runs: the public
``num_workers`` and ``prefetch_factor`` attributes. A persistent pool is shut down and
built anew at that iter() (its start counts in that epoch's figures), and the batches
keep their order (order.py). An IterableDataset's worker count decides how it is
split: the tuner never changes it there. Where a change would change the order, the
tuner only says what it would set.

Where the pool can change without changing what the loop sees (a torch DataLoader over a
map-style dataset, batches in order, a sampler that lets a new pool keep the order), the
tuner judges windows of WINDOW seconds in the loop and changes the pool mid-epoch
(switch.py); a new pool's first batches are not judged (its start is its own
figure). Elsewhere an epoch still running after LONG_EPOCH (one-epoch pre-training) is
judged in the loop: a loader that resumes exactly from its state_dict() (torchdata's
StatefulDataLoader) takes a prefetch_factor change there: state_dict(), the setting,
load_state_dict() and a new iterator from the same batch (resume(),
iter_start._resumer); anything else is only said.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any

import torch
import torch.utils.data

from dataloader_exporter.core.settings import ENV_SETTINGS, SettingsError, log_name, parse
from dataloader_exporter.core.tuner.judge import DRIFT
from dataloader_exporter.core.tuner.persist import as_kept, keep_pool
from dataloader_exporter.core.tuner.rules import REASONS_OF, Tuner
from dataloader_exporter.core.tuner.types import Budget, Decision, Epoch, Setting

from .. import compat
from ..envsettings import once
from ..failure_causes import is_torch_worker_error
from ..hotpath.recorder import LoaderRecorder
from .budget import budget
from .epoch import MIN_BATCHES, Mark, epoch_since, paused, setting_of, take_mark
from .keep import Keeping
from .order import Wrap, fresh_seed, order_bound

log = logging.getLogger("dataloader_exporter.instrument")

LONG_EPOCH = 600.0  # seconds: an epoch running longer is judged, as advice only
WINDOW = 3.0  # seconds: a window judged mid-epoch


@dataclass(frozen=True)
class Undo:
    """What a change from no workers to some replaced, to put back if the new pool cannot
    start or fails its first batch (a dataset that cannot run in a worker): the settings,
    and the loader's generator and torch's CPU RNG as they were before torch's iter()."""

    setting: Setting
    prefetch: int | None
    generator: torch.Tensor | None
    cpu: torch.Tensor


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


ITERABLE = ("its IterableDataset's worker count decides how its stream is split, so it is "
            "set for the next run, not this one")


def persist_mode(loader: Any, knobs: tuple[str, ...], wish: bool) -> str:
    """How the tuner treats persistent_workers (keep.py): "torch" for a loader built
    persistent (or not asked), "auto" where persistent_workers=auto, "true" where
    persistent_workers=true could not be set because the loader was built without workers
    and num_workers=auto."""
    if getattr(loader, "persistent_workers", False):
        return "torch"
    if "persistent_workers" in knobs:
        return "auto"
    return "true" if wish and "num_workers" in knobs else "torch"


class LoaderTuning:
    """One loader object's tuner, fed at each iter() (Instruments.at_iter)."""

    def __init__(self, name: str, knobs: tuple[str, ...], loader: Any,
                 rec: LoaderRecorder, wish: bool = False) -> None:
        """wish: persistent_workers=true was asked beside num_workers=auto."""
        self.name = name
        self.rec = rec
        self.keeping = Keeping(name, loader, persist_mode(loader, knobs, wish))
        self.keeping.say_why_not()
        iterable = isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset)
        workers = "num_workers" in knobs and not iterable
        if "num_workers" in knobs and iterable:
            once.problem(f"tune-iterable:{name}", "dataloader %r: num_workers=auto is not "
                         "applied: its dataset is an IterableDataset, whose worker count "
                         "decides how it is split; only prefetch_factor is tuned",
                         log_name(name))
        self.tuner = Tuner(setting_of(loader), workers=workers,
                           prefetch="prefetch_factor" in knobs)
        # An IterableDataset's count is not set, but what the model says is said, once.
        self.shadow = (Tuner(setting_of(loader), prefetch=False)
                       if "num_workers" in knobs and iterable else None)
        # Where a change would change the order of the batches, the tuner only advises.
        self.advice_only = order_bound(loader, self.tuner.start.workers)
        if iterable and getattr(loader, "persistent_workers", False):
            self.advice_only = ("its IterableDataset's stream lives in its persistent workers: "
                                "a new pool would start it anew")
        self._lock = threading.RLock()  # a flush inside at_iter calls tick()
        self._mark: Mark | None = None
        self._said_stable = False
        self._advised = False
        self.undo: Undo | None = None  # armed by a change from no workers, for one iter()
        # A loader that resumes exactly from its state_dict() (torchdata's
        # StatefulDataLoader) takes a prefetch_factor change mid-epoch (resume()).
        self.resumable = (callable(getattr(loader, "state_dict", None))
                          and callable(getattr(loader, "load_state_dict", None)))
        self.pending: Decision | None = None  # decided in a long epoch, made at resume()
        # A torch DataLoader whose pool can change mid-epoch with the order kept.
        self.midepoch = (not iterable and not self.advice_only and not self.resumable
                         and isinstance(loader, torch.utils.data.DataLoader)
                         and getattr(loader, "in_order", True) is not False)
        self._warming = False  # a new pool's first batches: not judged
        self._kept_now = False  # auto just decided to keep its pool (_verdict)
        self._window_at_iter = True  # the window judged next began at an iter()
        rec.on_flush = self.tick
        self.tuned = tuple(k for k in knobs if (k != "num_workers" or workers) and (
            k != "persistent_workers" or self.keeping.deciding))
        if self.advice_only:
            log.info("dataloader %r: the tuner only says what it would set: %s",
                     log_name(name), self.advice_only)
        elif self.tuned:  # exported only where the tuner sets something
            rec.tuner_stable = False
            rec.tuner_settings = ",".join(self.tuned)
            for setting in self.tuned:
                for reason in REASONS_OF[setting]:
                    rec.tuner_changes.setdefault((setting, reason), 0)
            when = (f"every {WINDOW:g} s mid-epoch" if self.midepoch
                    else "between epochs")
            log.info("dataloader %r: the tuner sets %s %s, from num_workers=%d, prefetch_factor"
                     "=%d", log_name(name), " and ".join(self.tuned), when,
                     self.tuner.start.workers, self.tuner.start.prefetch)

    def at_iter(self, loader: Any, forget_workers: Callable[[], None]) -> Wrap | None:
        """Judges the epoch since the last iter() and applies a change to `loader` before
        torch's iter() runs. Returns what torch's __iter__ is to be wrapped in (None: run
        as it is): a persistent pool rebuilt gets its base seed (fresh_seed), a kept one
        its workers' seeds (keep.py). Never raises: the tuner must never stop training."""
        try:
            with self._lock:
                seed = None
                self.undo = None
                mark, self._mark = self._mark, None
                pending, self.pending = self.pending, None
                if pending is not None:  # decided in a long epoch that ended first: now
                    seed = self._apply(loader, pending, forget_workers)
                elif mark is not None and self._partial(mark):
                    pass  # the tail of an epoch after a mid-epoch window: too short
                elif mark is not None and (
                        epoch := epoch_since(self.rec, mark, self.name)) is not None:
                    room = budget()  # read once: auto's verdict and the tuner's judge it
                    judged = self._once(epoch, room, mark)
                    if self.advice_only:
                        self._advise(copy.deepcopy(self.tuner).observe(epoch, room),
                                     self.advice_only)
                        self.tuner.stable = True
                    else:
                        if self.shadow is not None:
                            shadow, self.shadow = self.shadow, None
                            self._advise(shadow.observe(epoch, room), ITERABLE)
                        decision = self._observe(epoch, room) if judged else None
                        if decision is not None:
                            seed = self._apply(loader, decision, forget_workers)
                wrap = self._keep(loader, forget_workers)
                self._say_stable()
                if not self.tuner.stable or self.rec.tuner_stable or self._deciding():
                    pool = compat.persistent_iterator(loader)
                    self._mark = take_mark(self.rec, loader, fresh_pool=bool(
                        loader.num_workers) and (pool is None or not loader.persistent_workers),
                        persists=bool(loader.persistent_workers))
                self._window_at_iter, self._warming = True, False
                if seed is not None:
                    return functools.partial(fresh_seed, seed=seed)
                return wrap
        except Exception as e:
            if is_torch_worker_error(e):
                raise  # torch's word that a worker died goes on to the loop
            log.warning("dataloader %r: the tuner failed and stops; the loader keeps its "
                        "settings", log_name(self.name), exc_info=True)
            self.tuner.stable = True
            self.rec.tuner_stable = None  # no tuner runs: its series go
            with contextlib.suppress(Exception):
                self.keeping.release(loader, forget_workers)
            return None

    def _once(self, epoch: Epoch, room: Budget, mark: Mark) -> bool:
        """auto's verdict on keeping its pool made (_verdict); whether the tuner judges
        `epoch`: not where a persistent pool started at its iter(): the epoch paid a start
        the epochs to come will not, so its rate says nothing of them (as a new pool's
        first batches mid-epoch)."""
        self._verdict(epoch, room)
        return not (epoch.start_s is not None and mark.persists)

    def _observe(self, epoch: Epoch, room: Budget) -> Decision | None:
        """The tuner's judgement of `epoch`; a drift said; a pool kept from now on (auto's
        verdict just made on `epoch`) is judged as it will run, without its start
        (persist.as_kept), and starts its setting's rates anew (those seen paid it)."""
        if self._kept_now:
            epoch = as_kept(epoch)
        settled = self.tuner.stable
        decision = self.tuner.observe(epoch, room)
        if settled and not self.tuner.stable:
            self._drifted()
        if self._kept_now:
            self._kept_now = False
            self.tuner.pool_kept()
        return decision

    def _verdict(self, epoch: Epoch, room: Budget) -> None:
        """auto's verdict on keeping the pool whose start `epoch` measured, made at the
        next iter() (core/tuner/persist.py); a verdict not to keep stands once the tuner
        has settled."""
        keeping = self.keeping
        if not keeping.deciding or epoch.start_share is None:
            return
        keep, why = keep_pool(epoch, room)
        if keeping.decided(keep, why):
            self._kept_now = True
            self._count("persistent_workers", "epoch-start")
            self._said_stable = False  # the stable line says it
        elif self.tuner.stable:
            keeping.final = True

    def _keep(self, loader: Any, forget_workers: Callable[[], None]) -> Wrap | None:
        """persistent_workers under the tuner (keep.py), auto's verdict made (_once): the
        loader's pool as it is to be at this iter(), and a kept pool let go, counted and
        said, where the training changed the dataset."""
        keeping = self.keeping
        wrap, changed = keeping.prepare(loader, forget_workers)
        if changed is not None:
            self._count("persistent_workers", "dataset-changed")
            log.warning("dataloader %r: persistent_workers True -> False: %s",
                        log_name(self.name), keeping.why_not)
            self._said_stable = False
        return wrap

    def _apply(self, loader: Any, decision: Decision,
               forget_workers: Callable[[], None]) -> int | None:
        s = decision.setting
        old = compat.persistent_iterator(loader) if getattr(
            loader, "persistent_workers", False) else None
        before = loader.num_workers, loader.prefetch_factor
        if decision.name == "num_workers" and decision.old == 0:
            gen = getattr(loader, "generator", None)
            self.undo = Undo(setting_of(loader), before[1],
                             gen.get_state() if isinstance(gen, torch.Generator) else None,
                             torch.get_rng_state())
        try:  # both or neither: torch needs a prefetch_factor with workers
            loader.prefetch_factor = s.prefetch if s.workers else None
            loader.num_workers = s.workers
            if (old is not None and s.workers == before[0]
                    and compat.deepen(old, s.prefetch)):
                old = None  # the same pool, its queue's depth changed at its next iter()
            elif old is not None and not compat.shut_down(loader, old):
                raise RuntimeError("cannot end its persistent workers (torch's private "
                                   "_iterator or _shutdown_workers is missing)")
        except BaseException:
            for attr, value in zip(("num_workers", "prefetch_factor"), before, strict=True):
                with contextlib.suppress(Exception):
                    if getattr(loader, attr) != value:
                        setattr(loader, attr, value)
            raise
        seed = None
        if old is not None:  # the pool torch would have reused had the old settings
            if self.keeping.mode == "torch":  # else a new pool draws as the untuned one
                seed = compat.base_seed(old)
            forget_workers()
        self._count(decision.name, decision.reason)
        rebuilt = " (its persistent workers start anew)" if old is not None else ""
        log.warning("%s%s", decision.line(log_name(self.name)), rebuilt)
        return seed

    def _count(self, setting: str, reason: str) -> None:
        """One change made, in dataloader_tuner_changes_total."""
        changes = self.rec.tuner_changes
        changes[(setting, reason)] = changes.get((setting, reason), 0) + 1

    def cannot_run(self, loader: Any, undo: Undo, error: Exception) -> bool:
        """The change `undo` records could not run: puts the loader's settings and RNGs back
        as they were before its iter() (so the retried epoch draws the same order) and
        stops adding workers. False when it cannot (training then sees the error)."""
        if undo is not self.undo:
            return False
        self.undo = None
        try:
            with self._lock:
                now = loader.num_workers
                loader.num_workers = undo.setting.workers
                loader.prefetch_factor = undo.prefetch
                gen = getattr(loader, "generator", None)
                if undo.generator is not None and isinstance(gen, torch.Generator):
                    gen.set_state(undo.generator)
                torch.set_rng_state(undo.cpu)
                self.keeping.release(loader, lambda: None)  # the failed pool, if kept
                self.tuner.cannot_run(undo.setting)
                self._count("num_workers", "reverted")
        except Exception:
            log.warning("dataloader %r: the tuner cannot undo its change",
                        log_name(self.name), exc_info=True)
            return False
        say_failed(self.name, now, undo.setting.workers, error, "starts again")
        self._said_stable = False
        self._say_stable()
        return True

    def _say_stable(self) -> None:
        if self.tuner.memory_note:
            once.problem(f"tune-copies:{self.name}", "dataloader %r: %s", log_name(self.name),
                         self.tuner.memory_note)
        if not self.tuner.stable or self._said_stable or self._deciding():
            return
        self._said_stable = True
        if self.rec.tuner_stable is None:
            return  # it advised, stopped, or had nothing to set: no settings line
        self.rec.tuner_stable = True
        line = self.tuner.settings_line(self.name)
        keeping, workers = self.keeping, self.tuner.current.workers
        keep = ""
        if keeping.mode != "torch" and workers and not keeping.deciding:
            keep = f", persistent_workers={keeping.kept}"
            line = ",".join(x for x in (line, f"{self.name}.persistent_workers="
                                        f"{str(keeping.kept).lower()}") if x)
        try:
            parse(line or "")
        except SettingsError:
            line = None  # a name a settings line cannot hold
        if line:
            log.warning("dataloader %r: the tuner is stable at num_workers=%d, "
                        "prefetch_factor=%d%s; to keep them without tuning: %s=%s",
                        log_name(self.name), workers, self.tuner.current.prefetch, keep,
                        ENV_SETTINGS, line)

    def _deciding(self) -> bool:
        """Whether auto has yet to say whether it keeps the workers the tuner runs."""
        return self.keeping.deciding and self.tuner.current.workers > 0

    def tick(self) -> None:
        """After a flush (a reader's thread, or the loop's own reading): an epoch running
        past LONG_EPOCH is judged. A prefetch_factor change of a loader that resumes
        exactly from its state_dict() is decided, to be made at the loop's next reading
        (resume()); anything else is said once, not applied."""
        mark = self._mark
        if self._advised or mark is None or self.pending is not None:
            return
        if self.tuner.stable and not (self.midepoch and self.rec.tuner_stable):
            return  # settled: watched mid-epoch where it can change there, else at iter()
        now = perf_counter_ns()
        if self.midepoch:  # judged in the loop only: a paused loop is no slow window
            if threading.get_native_id() == self.rec.loop_tid:
                self._window(mark, now)
            return
        if (now - mark.t_ns) / 1e9 < LONG_EPOCH:
            return
        with self._lock:
            if self._advised or self._mark is not mark:
                return
            epoch = epoch_since(self.rec, mark, self.name, flush=False, end_ns=now)
            if epoch is None:
                return
            self._advised = True
            room = budget()
            decision = copy.deepcopy(self.tuner).observe(epoch, room)
            if (self.resumable and not self.advice_only
                    and (decision is None or decision.name == "prefetch_factor")):
                self.pending = self.tuner.observe(epoch, room)  # the same, made
                if self.pending is None:
                    self._say_stable()
                return
        because = (f"its epoch has run {(now - mark.t_ns) / 1e9:.0f} s, and a change needs a "
                   "new iterator")
        if self.resumable and decision is not None and decision.name == "num_workers":
            because += (" (a state_dict() saved under one num_workers does not resume under "
                        "another)")
        self._advise(decision, because)

    def resume(self, loader: Any) -> bool:
        """In the loop, mid-epoch: makes the pending prefetch_factor change of a loader
        that resumes exactly: its state_dict() now, the new setting, load_state_dict(); the
        caller then builds its next iterator, which goes on from that very batch. False
        when there is none to make or it could not be made (the loader keeps its
        setting, and the tuner stops)."""
        with self._lock:
            decision, self.pending = self.pending, None
            if decision is None:
                return False
            before = loader.prefetch_factor
            try:
                state = loader.state_dict()
                loader.prefetch_factor = decision.setting.prefetch
                loader.load_state_dict(state)
            except Exception as e:
                with contextlib.suppress(Exception):
                    loader.prefetch_factor = before
                if is_torch_worker_error(e):
                    raise
                log.warning("dataloader %r: the tuner cannot resume it mid-epoch; it keeps "
                            "its settings and the tuner stops", log_name(self.name),
                            exc_info=True)
                self.tuner.stable = True
                self.rec.tuner_stable = None
                return False
            self._count(decision.name, decision.reason)
            log.warning("%s (mid-epoch: resumed from its state_dict())",
                        decision.line(log_name(self.name)))
            return True

    def remark(self, loader: Any, warming: bool = False) -> None:
        """A mid-epoch change was made: the window judged next starts now. warming: a new
        pool, whose first batches only start the window."""
        with self._lock:
            self._mark = take_mark(self.rec, loader, mid=True)
            self._advised = False
            self._warming = warming
            self._window_at_iter = False
            self._say_stable()

    def _advise(self, decision: Decision | None, because: str) -> None:
        """Says what the tuner would set, once, without setting it."""
        if decision is None:
            return
        once.problem(f"tune-advice:{self.name}", "dataloader %r: the tuner would set %s %d -> "
                     "%d (%s) but leaves it: %s. To set it: %s=%s.%s=%d", log_name(self.name),
                     decision.name, decision.old, decision.new, decision.why, because,
                     ENV_SETTINGS, self.name, decision.name, decision.new)

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
        in the loop: judged, and its change left pending for the loop (switch.py)."""
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
                room = budget()
                if self._once(epoch, room, mark):  # watched: tuned again if its rate drifts
                    self.pending = self._observe(epoch, room)
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
                self.keeping.at_switch(loader)
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
                self.keeping.release(loader, lambda: None)  # the failed pool, if kept
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
