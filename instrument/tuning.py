"""The loader tuner at work (issue 22): core/tuner.py decides, this measures and applies.

A loader is tuned only when asked: ``auto`` in $DATALOADER_EXPORTER_SETTINGS
(``train.num_workers=auto``) or ``tune=`` on instrument.DataLoader. At each iter() the
epoch that ran since the previous iter() is judged from what the loader measured:

- samples (or batches) per second and the input stall, over the wall time from iter() to
  the last batch handed out, so a worker pool's start (and its rebuild) counts;
- the workers' running / waiting-for-a-CPU / blocked shares (procstat.py) over the epoch;
- the memory one worker takes (PSS, else its largest RSS; with no worker yet, the main
  process's RSS, which a forked worker can at most take), and a batch's bytes;
- the fetch waits' burstiness (95th percentile over the median, from the histogram);

against this rank's budget, read each time: its cores (advisor.worker_cores, the share of
the cores its affinity and cgroup allow per local rank), the memory room left (cgroup or
host, keeping bands.MEMORY_RESERVE free) and /dev/shm free.

A change is applied only between iterators, before torch's __iter__ runs: the public
``num_workers`` and ``prefetch_factor`` attributes. A persistent pool is shut down and
built anew at that iter() (its start counts in that epoch's figures); the new iterator's
base seed is drawn from a generator of its own, so the loader's generator (and the
shuffling order it drives) advances exactly as without the rebuild. Map-style batches
come in the same order whatever the worker count. An IterableDataset's worker count
decides how it is split: the tuner never changes it there.

An epoch still running after LONG_EPOCH (one-epoch pre-training) is judged in the loop. A
loader that resumes exactly from its state_dict() (torchdata's StatefulDataLoader) takes a
prefetch_factor change there: state_dict(), the setting, load_state_dict() and a new
iterator from the same batch (resume(), timed._resumer). A num_workers change is only
said: no torch loader resumes mid-epoch under another worker count (torchdata refuses a
state saved with a different num_workers).
So is a loader whose sampler draws its order when an iterator is built (_order_bound),
where a new pool would change the order.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter_ns
from typing import Any

import numpy as np
import torch
import torch.utils.data
import torch.utils.data.distributed

from dataloader_exporter.core import advisor, bands
from dataloader_exporter.core.facts.cgroup import (
    CGROUP,
    PROC,
    limits,
    memory_files,
    memory_room,
    read_value,
)
from dataloader_exporter.core.facts.memory import host_memory
from dataloader_exporter.core.facts.shm import SHM_PATH, shm_space
from dataloader_exporter.core.settings import ENV_SETTINGS, SettingsError, log_name, parse
from dataloader_exporter.core.tuner import REASONS_OF, Budget, Decision, Epoch, Setting, Tuner

from . import compat
from .env import local_world_size
from .envsettings import once
from .failures import is_torch_worker_error
from .procstat import Figures
from .recorder import LoaderRecorder

log = logging.getLogger("dataloader_exporter.instrument")

MIN_BATCHES = 8  # an epoch with fewer batches says too little to judge
BURST_FLOOR = 0.001  # seconds: a 95th-percentile wait below this is not a burst
LONG_EPOCH = 600.0  # seconds: an epoch running longer is judged, as advice only
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def knobs_of(tune: bool | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """instrument.DataLoader's ``tune=``: True for both settings, or their names."""
    if tune is True:
        return ("num_workers", "prefetch_factor")
    if tune is False:
        return ()
    names = tuple(tune)
    unknown = [n for n in names if n not in ("num_workers", "prefetch_factor")]
    if unknown or isinstance(tune, str):
        raise ValueError(f"tune: expected True, False or names among num_workers and "
                         f"prefetch_factor, got {tune!r}")
    return names


def memory_budget() -> int | None:
    """Memory more workers may take: the room this process's container (or the host) has
    left, less bands.MEMORY_RESERVE of its limit (or of the host's memory)."""
    try:
        total, available = host_memory()
        room = memory_room(total, available)
        whole = total
        files = memory_files(Path(PROC), Path(CGROUP))
        if files is not None:
            limit = read_value(files[0])
            if limit is not None and limits(limit, total):
                whole = limit
        return room - int(bands.MEMORY_RESERVE * whole)
    except Exception:  # a figure that cannot be read is unknown: it blocks growth
        return None


def budget() -> Budget:
    """What this rank may use now."""
    cores = advisor.worker_cores(advisor.local_cpu(), local_world_size(),
                                 torch.cuda.is_initialized())
    shm = shm_space(SHM_PATH)
    return Budget(cores, memory_budget(), shm.free if shm is not None else None)


def _own_rss() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def burstiness(counts: np.ndarray, bounds: tuple[float, ...]) -> float | None:
    """The 95th percentile of the waits over their median, from histogram bucket counts
    (upper bounds); None when either falls past the last bound or no wait was seen."""
    total = int(counts.sum())
    if total <= 0:
        return None
    cum = np.cumsum(counts)
    p50 = int(np.searchsorted(cum, 0.5 * total))
    p95 = int(np.searchsorted(cum, 0.95 * total))
    if p95 >= len(bounds):
        return None
    if bounds[p95] < BURST_FLOOR:
        return 1.0  # waits this short are no burst, whatever their ratio
    return bounds[p95] / bounds[p50]


def _text(s: Setting) -> str:
    return f"num_workers={s.workers}, prefetch_factor={s.prefetch}"


def _times(fig: Figures | None) -> tuple[int | None, int | None, int | None]:
    """The workers' running, waiting-for-a-CPU and blocked nanoseconds so far."""
    if fig is None:
        return None, None, None
    return fig.running_ns, fig.waiting_ns, fig.blocked_ns


def _worker_bytes(fig: Figures | None, active: int) -> int | None:
    """The memory one worker takes: PSS per live worker, else the largest worker's RSS,
    else (no worker read yet) the training process's own RSS."""
    if fig is not None and active and fig.pss_bytes:
        return fig.pss_bytes // active
    if fig is not None and fig.max_rss_bytes:
        return fig.max_rss_bytes
    return _own_rss()


def _setting(loader: Any) -> Setting:
    return Setting(int(loader.num_workers or 0), int(loader.prefetch_factor or 2))


def _order_bound(loader: Any, workers: int) -> str | None:
    """Why a new worker pool would change the order of this loader's batches, or None.

    torch builds the sampler's iterator once in a single-process iterator and twice in a
    multi-process one (and once more at each epoch of a persistent pool). A sampler whose
    __iter__ is a generator function draws its order lazily, at the first index: the
    count does not matter. One that draws it when the iterator is built (torchdata's
    StatefulDataLoader samplers, a custom __iter__ returning iter(list)) consumes its
    generator once more per build: going from no workers to some, or rebuilding a
    persistent pool, would change the order, tuner or person alike."""
    index = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    if _lazy(index):
        return None
    if workers and not getattr(loader, "persistent_workers", False):
        return None  # among worker counts of 1 and more (never 0: see core/tuner.py)
    pool = "rebuilding its persistent workers" if workers else "starting workers"
    return (f"its sampler ({type(index).__qualname__}) draws its order when an iterator is "
            f"built, so {pool} would change the order of the batches")


def _lazy(sampler: Any, depth: int = 0) -> bool:
    """Whether building the sampler's iterator draws nothing: its __iter__ is a generator
    function; torch's SequentialSampler and DistributedSampler (no shared RNG: the
    latter seeds its own from seed + epoch); or Accelerate's shard of a batch sampler,
    whose __iter__ returns its own generator over the sampler it holds, lazy if that is."""
    if inspect.isgeneratorfunction(getattr(type(sampler), "__iter__", None)):
        return True
    if isinstance(sampler, (torch.utils.data.SequentialSampler,
                            torch.utils.data.distributed.DistributedSampler)):
        return True
    inner = getattr(sampler, "batch_sampler", None)
    return (depth < 3 and inner is not None
            and type(sampler).__module__.startswith("accelerate.")
            and _lazy(inner, depth + 1))


@dataclass(frozen=True)
class Undo:
    """What a change from no workers to some replaced, to put back if the new pool cannot
    start or fails its first batch (a dataset that cannot run in a worker): the settings,
    and the loader's generator and torch's CPU RNG as they were before torch's iter()."""

    setting: Setting
    prefetch: int | None
    generator: torch.Tensor | None
    cpu: torch.Tensor


@dataclass(frozen=True)
class _Mark:
    """A loader's counters at an epoch's iter()."""

    setting: Setting
    t_ns: int
    batches: int
    samples: int
    step_s: float
    fetch_counts: np.ndarray
    proc: tuple[int | None, int | None, int | None]
    iters: int  # iter()s of every loader of this name so far


class LoaderTuning:
    """One loader object's tuner, fed at each iter() (Instruments.at_iter)."""

    def __init__(self, name: str, knobs: tuple[str, ...], loader: Any,
                 rec: LoaderRecorder) -> None:
        self.name = name
        self.rec = rec
        iterable = isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset)
        workers = "num_workers" in knobs and not iterable
        if "num_workers" in knobs and iterable:
            once.problem(f"tune-iterable:{name}", "dataloader %r: num_workers=auto is not "
                         "applied: its dataset is an IterableDataset, whose worker count "
                         "decides how it is split; only prefetch_factor is tuned",
                         log_name(name))
        self.tuner = Tuner(_setting(loader), workers=workers,
                           prefetch="prefetch_factor" in knobs)
        # Where a change would change the order of the batches, the tuner only advises.
        self.advice_only = _order_bound(loader, self.tuner.start.workers)
        if iterable and getattr(loader, "persistent_workers", False):
            self.advice_only = ("its IterableDataset's stream lives in its persistent workers: "
                                "a new pool would start it anew")
        self._lock = threading.RLock()  # a flush inside at_iter calls tick()
        self._mark: _Mark | None = None
        self._said_stable = False
        self._advised = False
        self.undo: Undo | None = None  # armed by a change from no workers, for one iter()
        # A loader that resumes exactly from its state_dict() (torchdata's
        # StatefulDataLoader) takes a prefetch_factor change mid-epoch (resume()).
        self.resumable = (callable(getattr(loader, "state_dict", None))
                          and callable(getattr(loader, "load_state_dict", None)))
        self.pending: Decision | None = None  # decided in a long epoch, made at resume()
        rec.on_flush = self.tick
        self.tuned = tuple(k for k in knobs if k != "num_workers" or workers)
        if self.advice_only:
            log.info("dataloader %r: the tuner only says what it would set: %s",
                     log_name(name), self.advice_only)
        elif self.tuned:  # exported only where the tuner sets something
            rec.tuner_stable = False
            rec.tuner_settings = ",".join(self.tuned)
            for setting in self.tuned:
                for reason in REASONS_OF[setting]:
                    rec.tuner_changes.setdefault((setting, reason), 0)
            log.info("dataloader %r: the tuner sets %s between epochs, from %s",
                     log_name(name), " and ".join(self.tuned), _text(self.tuner.start))

    def at_iter(self, loader: Any, forget_workers: Callable[[], None]) -> int | None:
        """Judges the epoch since the last iter() and applies a change to `loader` before
        torch's iter() runs. Returns the base seed for a persistent pool rebuilt here (see
        fresh_seed), else None. Never raises: the tuner must never stop training."""
        try:
            with self._lock:
                seed = None
                self.undo = None
                mark, self._mark = self._mark, None
                pending, self.pending = self.pending, None
                if pending is not None:  # decided in a long epoch that ended first: now
                    seed = self._apply(loader, pending, forget_workers)
                elif mark is not None and not self.tuner.stable:
                    epoch = self._epoch(mark)
                    if epoch is not None and self.advice_only:
                        self._advise(copy.deepcopy(self.tuner).observe(epoch, budget()),
                                     self.advice_only)
                        self.tuner.stable = True
                    elif epoch is not None:
                        decision = self.tuner.observe(epoch, budget())
                        if decision is not None:
                            seed = self._apply(loader, decision, forget_workers)
                self._say_stable()
                if not self.tuner.stable:
                    self._mark = self._take_mark(loader)
                return seed
        except Exception as e:
            if is_torch_worker_error(e):
                raise  # torch's word that a worker died goes on to the loop
            log.warning("dataloader %r: the tuner failed and stops; the loader keeps its "
                        "settings", log_name(self.name), exc_info=True)
            self.tuner.stable = True
            self.rec.tuner_stable = None  # no tuner runs: its series go
            return None

    def _take_mark(self, loader: Any) -> _Mark:
        rec = self.rec
        rec.flush()
        with rec.lock:
            step_s, counts = rec.step_h.sum, rec.fetch_h.counts.copy()
        return _Mark(_setting(loader), perf_counter_ns(), rec.batches, rec.samples, step_s,
                     counts, _times(rec.workers.proc_figures()), rec.iters)

    def _epoch(self, mark: _Mark, flush: bool = True, end_ns: int | None = None
               ) -> Epoch | None:
        """What the epoch since `mark` measured; None when too short to judge."""
        rec = self.rec
        if flush:
            rec.flush()
        end = rec.last_batch_ns if end_ns is None else end_ns
        if rec.iters > mark.iters + 1:  # another loader of this name ran in the window
            once.problem(f"tune-shared:{self.name}", "dataloader %r: the tuner cannot judge "
                         "an epoch while another loader of the same name runs in it (their "
                         "figures add up); give each loader its own name",
                         log_name(self.name))
            return None
        batches = rec.batches - mark.batches
        if batches < MIN_BATCHES or end <= mark.t_ns:
            return None
        wall = (end - mark.t_ns) / 1e9
        with rec.lock:
            step_s = rec.step_h.sum - mark.step_s
            counts = rec.fetch_h.counts - mark.fetch_counts
            bounds = rec.fetch_h.bounds
        known = rec.samples_known
        done = rec.samples - mark.samples if known else batches
        fig = rec.workers.proc_figures()  # read once for the shares and the memory
        now = _times(fig)
        before = mark.proc
        if before == (None, None, None) and None not in now:
            before = (0, 0, 0)  # no worker sampled at the mark: the sums began at 0 since
        shares: list[float | None] = [None, None, None]
        if None not in now and None not in before:
            spent = [int(a) - int(b) for a, b in zip(now, before, strict=True)]  # type: ignore[arg-type]
            total = sum(spent)
            if total > 0:
                shares = [s / total for s in spent]
        return Epoch(mark.setting, done / wall, max(0.0, min(1.0, 1 - step_s / wall)),
                     shares[0], shares[1], shares[2],
                     _worker_bytes(fig, rec.workers.active or 0),
                     rec.batch_bytes if rec.batch_bytes >= 0 else None,
                     burstiness(counts, bounds), "samples" if known else "batches")

    def _apply(self, loader: Any, decision: Decision,
               forget_workers: Callable[[], None]) -> int | None:
        s = decision.setting
        old = compat.persistent_iterator(loader) if getattr(
            loader, "persistent_workers", False) else None
        before = loader.num_workers, loader.prefetch_factor
        if decision.name == "num_workers" and decision.old == 0:
            gen = getattr(loader, "generator", None)
            self.undo = Undo(_setting(loader), before[1],
                             gen.get_state() if isinstance(gen, torch.Generator) else None,
                             torch.get_rng_state())
        try:  # both or neither: torch needs a prefetch_factor with workers
            loader.prefetch_factor = s.prefetch if s.workers else None
            loader.num_workers = s.workers
            if old is not None and not compat.shut_down(loader, old):
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
                self.tuner.cannot_run(undo.setting)
                self._count("num_workers", "reverted")
        except Exception:
            log.warning("dataloader %r: the tuner cannot undo its change",
                        log_name(self.name), exc_info=True)
            return False
        lines = str(error).strip().splitlines()
        said = lines[-1] if lines else ""  # torch's worker traceback ends with the error
        kind = type(error).__name__
        said = said[len(kind) + 2:] if said.startswith(f"{kind}: ") else said
        log.warning("dataloader %r: num_workers %d -> %d: its workers failed (%s: %s); the "
                    "epoch starts again without them and the tuner adds none",
                    log_name(self.name), now, undo.setting.workers, kind, said[:200])
        self._said_stable = False
        self._say_stable()
        return True

    def _say_stable(self) -> None:
        if not self.tuner.stable or self._said_stable:
            return
        self._said_stable = True
        if self.rec.tuner_stable is None:
            return  # it advised, stopped, or had nothing to set: no settings line
        self.rec.tuner_stable = True
        line = self.tuner.settings_line(self.name)
        try:
            parse(line or "")
        except SettingsError:
            line = None  # a name a settings line cannot hold
        if line:
            log.warning("dataloader %r: the tuner is stable at num_workers=%d, "
                        "prefetch_factor=%d; to keep them without tuning: %s=%s",
                        log_name(self.name), self.tuner.current.workers,
                        self.tuner.current.prefetch, ENV_SETTINGS, line)

    def tick(self) -> None:
        """After a flush (a reader's thread, or the loop's own reading): an epoch running
        past LONG_EPOCH is judged. A prefetch_factor change of a loader that resumes
        exactly from its state_dict() is decided, to be made at the loop's next reading
        (resume()); anything else is said once, not applied."""
        mark = self._mark
        if self._advised or mark is None or self.tuner.stable or self.pending is not None:
            return
        now = perf_counter_ns()
        if (now - mark.t_ns) / 1e9 < LONG_EPOCH:
            return
        with self._lock:
            if self._advised or self._mark is not mark:
                return
            epoch = self._epoch(mark, flush=False, end_ns=now)
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

    def remark(self, loader: Any) -> None:
        """A mid-epoch change was made: the window judged next starts now."""
        with self._lock:
            self._mark = self._take_mark(loader)
            self._advised = False
            self._say_stable()

    def _advise(self, decision: Decision | None, because: str) -> None:
        """Says what the tuner would set, once, without setting it."""
        if decision is None:
            return
        once.problem(f"tune-advice:{self.name}", "dataloader %r: the tuner would set %s %d -> "
                     "%d (%s) but leaves it: %s. To set it: %s=%s.%s=%d", log_name(self.name),
                     decision.name, decision.old, decision.new, decision.why, because,
                     ENV_SETTINGS, self.name, decision.name, decision.new)


def fresh_seed(torch_iter: Callable[[Any], Any], seed: int) -> Callable[[Any], Any]:
    """torch_iter for a persistent pool rebuilt by the tuner: torch's new iterator draws
    its base seed from a generator of its own (seeded from the old pool's), not from the
    loader's, so the loader's generator (and the sampler order it drives) advances as if
    the old pool had been reused."""
    def it(loader: Any) -> Any:
        user = loader.generator
        own = torch.Generator()
        own.manual_seed(seed)
        loader.generator = own
        try:
            return torch_iter(loader)
        finally:
            loader.generator = user
    return it
