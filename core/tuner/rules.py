"""The loader tuner's decisions: from one window's measured figures (an epoch, or a few
seconds of one) to the next window's num_workers and prefetch_factor, or to no change.
Pure: the instrumentation feeds it what it measured and applies what it decides.

Rules, from measured figures only (an unknown figure blocks the move it would justify):
- more workers only while the loop waits for input (stall at or over bands.MODERATE, and
  a wait whose removal the judge could tell from the noise: idle workers read as blocked,
  so the model asks for more however little the loop waits) and no worker waits for a
  CPU (under bands.CPU_CONTENTION): straight to the count the model
  (core/tuner/model.py) predicts removes the wait, from the per-batch figures (how long a
  batch takes to make and how much of it is CPU, the loop's time and CPU), within the
  budget: the rank's cores as CPU time (blocked workers take a small share each), memory,
  /dev/shm, the process and open-file limits; not by fewer than judge.MIN_GAIN of the
  workers it has (a rate grows at most as they do: the judge could not keep the trial).
  Without the per-batch figures: one worker more, or twice as many, while the workers
  run most of their time, up to the cores;
- fewer workers when CPU-bound workers outnumber the rank's cores or wait for a CPU
  (workers blocked most of their time while the loop is input-bound: only to the count
  the model says the cores hold, and only after CONTENDED windows running: their waits
  come in bursts), or
  when memory would not hold them; never none, for a loader that has workers;
- a deeper queue (prefetch_factor) when the loop waits in bursts (p95 far above the
  median) while the workers do not run most of their time;
- every change but a cut for memory is a trial, judged on the next window under the
  noise measured (core/tuner/judge.py): kept, undone (back to the best, that way never
  again), or measured once more: never slower than its own settings past a window or two.
  After MAX_TRIALS, or when no rule fires, it is stable (where the loop waits but the
  workers' shares are unknown, it waits UNSEEN_EPOCHS epochs for them), but for drift or
  doubt (a rate well below its own, or the model asking for more, window after window):
  it tunes again, and each time it settles back where it was it waits twice as long. A
  worker count a trial measured slower is tried again on a doubt as any trial, never
  kept on the model's word (trusted, judge.py) until the figures drift.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from dataloader_exporter.core import bands
from dataloader_exporter.core.tuner.judge import MIN_GAIN, Judge
from dataloader_exporter.core.tuner.model import ceiling, choose, predict
from dataloader_exporter.core.tuner.types import Budget, Decision, Epoch, Setting

MAX_TRIALS = 8  # then the tuner is stable, whatever the figures say
MAX_PREFETCH = 8  # batches per worker: deeper queues only hold memory
BURSTY = 4.0  # fetch wait p95 over its median at which the wait comes in bursts
BUSY = 0.5  # workers running at least this share of their time are the bottleneck
UNSEEN_EPOCHS = 2  # epochs to wait for unknown worker shares before settling
CONTENDED = 2  # windows running in which blocked workers wait for a CPU before a cut
REPROBE = 3  # settled windows in a row that ask for more workers: try once more
MAX_BACKOFF = 16  # the most the windows a drift or a doubt needs are multiplied by


# Why a setting changed: the loop waited on busy workers; they waited for a CPU; more
# workers than this rank's cores; memory would not hold them; the wait came in bursts;
# a trial did not help; a new pool's start stalled each epoch (a pool kept, core/tuner/
# persist.py); the training changed the dataset between epochs (a kept pool let go).
REASONS = ("starved", "cpu-contention", "cores", "memory", "bursty", "reverted",
           "epoch-start", "dataset-changed")
REASONS_OF = {"num_workers": ("starved", "cpu-contention", "cores", "memory", "reverted"),
              "prefetch_factor": ("bursty", "reverted"),
              "persistent_workers": ("epoch-start", "dataset-changed")}  # why each can change


@dataclass
class Tuner:
    """One loader's tuner. `workers`/`prefetch`: which settings it may change (an
    IterableDataset's worker count decides its sharding: never `workers` there)."""

    start: Setting
    workers: bool = True
    prefetch: bool = True
    best: Setting | None = None
    best_rate: float = 0.0
    trials: int = 0
    stable: bool = False
    current: Setting = field(init=False)
    budget: Budget = field(init=False)
    _exhausted: set[str] = field(default_factory=set)  # directions that did not help
    _trying: str | None = None  # the direction of the trial now running
    _unseen: int = 0  # epochs waited for the workers' shares
    _unit: str = "samples"  # what the rates count
    _judge: Judge = field(default_factory=Judge)
    settled_rate: float = 0.0  # the rate it settled at, against which drift is judged
    _doubts: int = 0  # windows running in which a ruled-out direction looked worth it
    _ceiling: int = 0  # the model's last ceiling: a window without its figures keeps it
    _backoff: int = 1  # multiplies the windows of a drift or doubt (doubled by a vain retune)
    _left: Setting | None = None  # the setting a retune left, until it settles
    retuned: str = ""  # why it last tuned again once settled: "drift" or "doubt"
    # The trial now running is a loader's first workers, which the model predicts faster
    # past the bar: one window more, kept unless their mean is slower at all (judge.py).
    _trusted: bool = False
    # Worker counts a trial measured slower (undone) since the figures last drifted: the
    # model's word for one of them is no longer trusted over that measurement.
    _refuted: set[int] = field(default_factory=set)
    # Why it added fewer workers than it wanted: the copies they will make of the dataset
    # (Epoch.worker_to_come) would not fit in memory; "" until then.
    memory_note: str = ""
    _contended: int = 0  # windows running in which blocked workers waited for a CPU

    def __post_init__(self) -> None:
        self.current = self.start
        self.budget = Budget(cores=max(1, self.start.workers))

    def observe(self, epoch: Epoch, budget: Budget) -> Decision | None:
        """The change for the next epoch, or None to keep the current setting. `budget`:
        what the rank may use, read now (the room left with the current workers)."""
        if epoch.setting != self.current:
            return None
        if epoch.unit != self._unit:  # samples could no longer be counted: rates restart
            self._unit, self.best_rate, self._trying = epoch.unit, 0.0, None
            self._judge = Judge()
        if self.stable:
            if not self.workers:
                return None
            if self._judge.drifted(epoch.samples_per_s, self.settled_rate,
                                   epoch.stall >= bands.MODERATE, self._backoff):
                self.retuned = "drift"
                self._refuted.clear()  # measured under other figures
            elif self._doubted(epoch, budget):
                self.retuned = "doubt"
            else:
                return None
            self.retune(epoch.samples_per_s)  # the figures drifted: tune again
        self.budget = budget
        self._judge.saw(epoch.setting, epoch.samples_per_s)
        rate = epoch.samples_per_s
        if self._trying is not None:
            trying = self._trying
            verdict, rate = self._judge.verdict(rate, self.best_rate, trying.endswith("+"),
                                                self._trusted)
            if verdict == "again":  # within the noise: one more window of the same
                return None
            self._trying, self._trusted = None, False
            if verdict == "undo":
                self._exhausted.add(trying)
                if trying == "num_workers+":
                    self._refuted.add(epoch.setting.workers)
                return self._revert(epoch, trying, rate)
            # A cut kept is the best now, still against the faster rate: cuts do not compound.
            self.best = self.current
            self.best_rate = max(self.best_rate, rate)
        if rate >= self.best_rate:
            self.best, self.best_rate = self.current, rate
        if self.trials >= MAX_TRIALS:
            self._settle(rate)
            return None
        decision = self._shrink(epoch) or self._grow(epoch) or self._deepen(epoch)
        if decision is None:
            if self._holding:
                return None  # a cut held back for one more window (_shrink)
            if self._blind(epoch) and self._unseen < UNSEEN_EPOCHS:
                self._unseen += 1  # the loop waits, but on what is not known yet
                return None
            self._settle(rate)
            return None
        self.trials += 1
        if decision.reason == "memory":
            # Memory would not hold them: not a trial, nothing to go back to past it.
            self.best, self.best_rate = decision.setting, 0.0
        if decision.reason in ("starved", "bursty"):
            self._trying = decision.name + "+"
        elif decision.reason in ("cpu-contention", "cores"):
            self._trying = decision.name + "-"
        self.current = decision.setting
        return decision

    def _doubted(self, epoch: Epoch, budget: Budget) -> bool:
        """Whether more workers, ruled out, look worth a second look: REPROBE windows
        running the loop waited and the model asked for more."""
        self.budget = budget
        grow = (self._wait_worth(epoch) and "num_workers+" in self._exhausted
                and self._modelled(epoch) and epoch.load is not None
                and choose(epoch.load, budget.cpus or 1.0, self._cap(epoch))
                > epoch.setting.workers)
        self._doubts = self._doubts + 1 if grow else 0
        return self._doubts >= REPROBE * self._backoff

    @property
    def _holding(self) -> bool:
        """A cut of blocked workers waiting for a CPU is held back: fewer than CONTENDED
        windows running have asked for it."""
        return 0 < self._contended < CONTENDED

    def _wait_worth(self, epoch: Epoch) -> bool:
        """Whether the loop's wait for input is worth more workers: at least bands.MODERATE
        of its time, and, removed entirely, a gain the judge could keep (its bar under the
        noise measured): a smaller one could only be kept by the noise, and idle workers
        (read as blocked) make the model ask for more whatever the gain."""
        stall = epoch.stall
        return stall >= bands.MODERATE and stall >= self._judge.bar() * (1 - stall)

    def _settle(self, rate: float) -> None:
        self.stable = True
        self.settled_rate = rate
        if self._left is not None:  # a retune that found nothing better: wait longer
            same = self._left == self.current
            self._backoff, self._left = min(MAX_BACKOFF, 2 * self._backoff) if same else 1, None

    def retune(self, rate: float) -> None:
        """Tunes again from the current setting (its rate now `rate`), all else forgotten."""
        self.stable, self._left = False, self.current
        self.trials, self._unseen, self._trying, self._doubts = 0, 0, None, 0
        self._contended = 0
        self._exhausted.clear()
        self._judge = Judge()
        self.best, self.best_rate = self.current, rate

    def pool_kept(self) -> None:
        """The current setting's pool is kept across epochs from now on: the rates seen
        under it, each of which paid the pool's start, are not its noise."""
        self._judge.seen.pop(self.current, None)

    def cannot_run(self, previous: Setting) -> None:
        """The change just made could not run (the first worker pool failed to start, or
        failed its first batch): back to `previous`, and no more workers, ever."""
        self.current = previous
        self._trying = None
        self._exhausted.add("num_workers+")
        self.stable = True

    def _blind(self, epoch: Epoch) -> bool:
        """The loop waited, but the workers' shares that would say why are unknown (a
        pool's first seconds are not sampled yet)."""
        return (self.workers and epoch.setting.workers > 0 and epoch.stall >= bands.MODERATE
                and (epoch.running is None or epoch.waiting_cpu is None))

    def _revert(self, epoch: Epoch, trying: str, measured: float) -> Decision:
        assert self.best is not None
        name = "num_workers" if trying.startswith("num_workers") else "prefetch_factor"
        old = epoch.setting.workers if name == "num_workers" else epoch.setting.prefetch
        new = self.best.workers if name == "num_workers" else self.best.prefetch
        self.current = self.best
        rate, best = f"{measured:.0f} {epoch.unit}/s", f"{self.best_rate:.0f}"
        bar = self._judge.bar()
        why = (f"{rate} did not beat {best} by {bar:.0%}" if trying.endswith("+") else
               f"{rate} fell more than {bar:.0%} below {best}")
        return Decision(self.best, name, old, new, "reverted", f"{why}: back to {new}")

    def _room_for(self, epoch: Epoch, workers: int, prefetch: int) -> str | None:
        """Why `workers` x `prefetch` would not fit the budget; None when it fits or the
        figure to judge it is unknown and the setting is no larger than now."""
        now = epoch.setting
        more = workers - now.workers
        if workers > self._cap(epoch) and more > 0:
            return "cores"
        if more > 0:
            if epoch.worker_bytes is None or self.budget.memory_room is None:
                return "memory unknown"
            if (more * epoch.worker_bytes + now.workers * epoch.worker_to_come
                    > self.budget.memory_room):
                return "memory"
        in_flight_now = now.workers * now.prefetch
        in_flight = workers * prefetch
        if in_flight > in_flight_now and workers > 0:
            if epoch.batch_bytes is None or self.budget.shm_room is None:
                return "shm unknown"
            extra = (in_flight - in_flight_now) * epoch.batch_bytes * bands.SHM_SAFETY
            if extra > self.budget.shm_room:
                return "shm"
        return None

    def _modelled(self, epoch: Epoch) -> bool:
        return epoch.load is not None and self.budget.cpus is not None

    def _cap(self, epoch: Epoch) -> int:
        """The most workers: the model's ceiling on the rank's CPU time (without its figures,
        its cores or its last ceiling), within the process and open-file limits."""
        if (cpus := self.budget.cpus) is not None and epoch.load is not None:
            cap = self._ceiling = ceiling(cpus)
        else:  # a window without the figures does not undo what they said
            cap = max(self.budget.cores, self._ceiling)
        room = self.budget.limit
        return cap if room is None else max(0, min(cap, epoch.setting.workers + room))

    def _grow(self, epoch: Epoch) -> Decision | None:
        if not self.workers or "num_workers+" in self._exhausted:
            return None
        n = epoch.setting.workers
        if not self._wait_worth(epoch):
            return None
        if n > 0 and (epoch.waiting_cpu is None or epoch.waiting_cpu >= bands.CPU_CONTENTION):
            return None
        trusted = False
        if self._modelled(epoch):
            assert epoch.load is not None and self.budget.cpus is not None
            want = choose(epoch.load, self.budget.cpus, self._cap(epoch))
            why = f"{epoch.load.line()}; loop waited {epoch.stall:.0%}, {self.budget.cpus:g} cores"
            trusted = n == 0 and want > 0 and want not in self._refuted and predict(
                epoch.load, want, self.budget.cpus) >= (1 + self._judge.bar()) * predict(
                epoch.load, 0, self.budget.cpus)
        else:
            if n > 0 and (epoch.running is None or epoch.running < BUSY):
                return None
            want = min(self.budget.cores, max(n + 1, 2 * n))
            free = self.budget.cores - n
            ran = "" if epoch.running is None else f"workers ran {epoch.running:.0%} of the time, "
            why = f"{ran}loop waited {epoch.stall:.0%}, {free} of {self.budget.cores} cores free"
        asked = want
        want = self._fitting(epoch, want, n)
        if epoch.worker_to_come and epoch.worker_bytes is not None and want < self._fitting(
                replace(epoch, worker_bytes=epoch.worker_bytes - epoch.worker_to_come,
                        worker_to_come=0), asked, n):  # the copies to come held it back
            self.memory_note = (
                f"num_workers held at {max(n, want)}, not {asked}: each worker will hold about "
                f"{epoch.worker_bytes >> 20} MiB once it has copied {epoch.copied} "
                f"(copy-on-read), and the {(self.budget.memory_room or 0) >> 20} MiB of memory "
                "left hold no more of them")
        if want <= n or (n > 0 and want < n * (1 + MIN_GAIN)):
            return None  # a rate grows at most as the workers do: too small to judge
        self._trusted = trusted
        return Decision(replace(epoch.setting, workers=want), "num_workers", n, want,
                        "starved", why)

    def _fitting(self, epoch: Epoch, want: int, n: int) -> int:
        """The most workers, from `want` down to n, the budget holds (_room_for)."""
        while want > n and self._room_for(epoch, want, epoch.setting.prefetch) is not None:
            want -= 1
        return want

    def _shrink(self, epoch: Epoch) -> Decision | None:
        n = epoch.setting.workers
        contended, self._contended = self._contended, 0
        if not self.workers or n == 0:
            return None
        cap = self._cap(epoch)
        if self._modelled(epoch):  # CPU-bound workers past the cores only queue for one
            assert epoch.load is not None and self.budget.cpus is not None
            if epoch.load.cpu_share >= BUSY:
                cap = min(cap, max(1, math.ceil(self.budget.cpus)))
        if n > cap and "num_workers-" not in self._exhausted:
            return Decision(replace(epoch.setting, workers=cap), "num_workers",
                            n, cap, "cores", f"{n} workers for {self.budget.cores} cores")
        if (epoch.waiting_cpu is not None and epoch.waiting_cpu >= bands.CPU_CONTENTION
                and "num_workers-" not in self._exhausted):
            # The loop's own CPU is in the figures. Workers blocked most of their time
            # (the model's figures say so) while the loop is input-bound wait for a CPU in
            # bursts: the model, which counts the CPU they take, says how many the cores
            # hold. (Idle workers count as blocked too: with little stall, they are cut.)
            # One window is not enough for them: a machine busy for a moment, or another
            # rank's pool starting, makes the same bursts, and a cut that restarts a kept
            # pool costs its start and an epoch not judged: the cut needs CONTENDED
            # windows running.
            modelled = self._modelled(epoch)
            if modelled and epoch.load is not None and (
                    epoch.load.cpu_share < BUSY and epoch.stall >= bands.INPUT_BOUND):
                assert self.budget.cpus is not None
                want = max(1, min(n, choose(epoch.load, self.budget.cpus, cap)))
                self._contended = contended + 1 if want < n else 0
                if self._holding:
                    want = n
            else:
                top = (math.ceil(self.budget.cpus) if modelled and self.budget.cpus
                       else self.budget.cores)
                want = max(1, min(top, math.ceil(n * (1 - epoch.waiting_cpu))))
            if want < n:
                return Decision(replace(epoch.setting, workers=want), "num_workers", n, want,
                                "cpu-contention",
                                f"workers waited for a CPU {epoch.waiting_cpu:.0%} of the "
                                f"time ({n} workers, {self.budget.cores} cores)")
        if (epoch.worker_bytes is not None and self.budget.memory_room is not None
                and self.budget.memory_room < 0):
            want = max(1, n - math.ceil(-self.budget.memory_room / max(1, epoch.worker_bytes)))
            if want < n:
                return Decision(replace(epoch.setting, workers=want), "num_workers", n, want,
                                "memory", f"memory is {-self.budget.memory_room} bytes short")
        return None

    def _deepen(self, epoch: Epoch) -> Decision | None:
        s = epoch.setting
        if (not self.prefetch or s.workers == 0 or "prefetch_factor+" in self._exhausted
                or epoch.stall < bands.MODERATE or epoch.burstiness is None
                or epoch.burstiness < BURSTY or epoch.running is None
                or epoch.running >= BUSY or s.prefetch >= MAX_PREFETCH):
            return None
        want = min(MAX_PREFETCH, 2 * s.prefetch)
        if self._room_for(epoch, s.workers, want) is not None:
            return None
        return Decision(replace(s, prefetch=want), "prefetch_factor", s.prefetch, want,
                        "bursty", f"the loop waited {epoch.stall:.0%} in bursts (p95 "
                        f"{epoch.burstiness:.1f}x the median) while workers ran "
                        f"{epoch.running:.0%} of the time")

    def settings_line(self, loader: str) -> str | None:
        """Once stable, the DATALOADER_EXPORTER_SETTINGS items that make it permanent."""
        if not self.stable:
            return None
        items = []
        if self.workers:
            items.append(f"{loader}.num_workers={self.current.workers}")
        if self.prefetch and self.current.workers:
            items.append(f"{loader}.prefetch_factor={self.current.prefetch}")
        return ",".join(items) or None
