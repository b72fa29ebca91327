"""A loader's instruments: its link to the recorder, the sinks and the advice, and what it
does at each turn of an iteration that the timed iterator (hotpath/iterator.py) reports:
iter(), the first batch, the end, an error, the tuner's readings. None of it runs per
batch but the timed transfer (hotpath/transfer.py)."""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from dataloader_exporter.core.envnames import ENV_DIR, getenv
from dataloader_exporter.core.facts.shm import SHM_PATH, shm_space
from dataloader_exporter.core.logonce import LogOnce
from dataloader_exporter.core.settings import SettingsError, log_name

from . import compat, envsettings, failure_causes
from .failure_causes import from_exitcode
from .hotpath.batch import batch_nbytes
from .hotpath.recorder import LoaderRecorder
from .hotpath.transfer import timed_to_device
from .hub import Hub, hub_for
from .preflight import LoaderConfig, Preflight, process_shm_size
from .rank import current_rank, local_world_size

if TYPE_CHECKING:  # the tuner is loaded for a tuned loader only
    from .hotpath.workerblock import Block
    from .tuner.loop import LoaderTuning
    from .tuner.order import Wrap

log = logging.getLogger("dataloader_exporter.instrument")

FINE_READ = 0.25  # seconds between readings of a loader tuned in windows mid-epoch
PROBE_EVERY = 1 << 15  # batches between readings of a tuned epoch (recorder.MAX_UNREAD / 4)
WAIT_WRITE = 1.0  # seconds the loop's exception waits for the snapshot of a dead worker


class Instruments:
    """One loader object's link to its recorder, sinks and advice.

    explicit: built by instrument.DataLoader or wrap() (not by zero-code mode), so a loader
    that is never iterated is worth a word (see zerocode/registry.py).
    """

    def __init__(self, name: str, registry: Any, metrics_dir: str | None,
                 port: int | None, explicit: bool = True, tune: tuple[str, ...] = ()) -> None:
        self.name = name
        self.tune = tune  # settings the tuner sets, given in code (instrument.DataLoader)
        # persistent_workers=True given in code beside a tuned num_workers, on a loader built
        # without workers (instrument.DataLoader): the tuner's pools are persistent.
        self.persist = False
        self.tuning: LoaderTuning | None = None
        self._tune_checked = False
        self._probe_start = 0  # the batch count at the start of the tuned epoch
        self._read_at = 0.0  # time.monotonic() of the tuner's last reading in the loop
        self._probe_last: int | None = None  # its next-to-last batch, when known
        self.registry = registry
        self.metrics_dir = metrics_dir
        self.port = port
        self.explicit = explicit
        self.loader_class: type | None = None  # the class of the loader adopted (zerocode/hooks.py)
        self.iterated = False
        self.gpu_checked = False  # to_device onto CUDA has looked up the GPU's UUID
        self.hub: Hub = hub_for(registry)
        # Advice is given once per loader name: a sweep that builds a loader per trial
        # is told once, and its loaders share the checks already made.
        self.preflight = self.hub.shared("preflight", name, lambda: Preflight(name))
        self.config = LoaderConfig(None, None, None, None, None)
        # The last start_epoch's settings: the config's inputs, the config (self.config),
        # the /dev/shm size and the recorder's labels made from them (LoaderRecorder.made).
        self._made: tuple[tuple[Any, ...], LoaderConfig, str, dict[str, str]] | None = None
        self.epochs = 0
        self.scanned = False  # the dataset looked at for copy-on-read (before_pool)
        self._last_it: weakref.ref[Any] | None = None  # the iterator whose workers we track
        self._last_gen = 0
        self._failures = LogOnce(log)  # one line per failure cause
        self._urgent_once: set[str] = set()  # causes whose first failure was waited for
        # Workers a loader started outside __iter__ (prestart): their iterator and block.
        self.started: tuple[weakref.ref[Any], Block] | None = None
        # The last iter()'s plan, while nothing needs planning again (iter_start._Kept).
        self.kept: Any = None
        directory = metrics_dir or getenv(ENV_DIR) or None
        if directory:
            self.hub.write_snapshots(directory)
        if port is not None:
            try:
                self.hub.serve(port)
            except OSError as e:
                log.warning("dataloader %r: cannot serve metrics on port %s: %s "
                            "(training goes on)", log_name(name), port, e)

    @functools.cached_property
    def rec(self) -> LoaderRecorder:
        """The recorder of this loader's name and rank (the rank as of first use)."""
        return self.hub.recorder(self.name, current_rank())

    def failed(self, cause: str, pid: int | None, seen: str) -> None:
        """One line per failure cause with what to change (failure_causes.fix)."""
        if self._failures.seen(cause):
            return
        rec = self.rec
        fig = rec.workers.proc_figures()
        live = rec.workers.active or 0
        rss = fig.rss_bytes // live if fig is not None and fig.rss_bytes and live else None
        who = f" (worker pid {pid})" if pid else ""
        grown = rec.workers.grown(pid) if pid else None
        text = failure_causes.fix(cause, seen, self.config, max(rec.batch_bytes, 0),
                                  local_world_size(), shm_space(SHM_PATH), rss,
                                  grown, rec.dataset_objects[:1])
        self._failures.problem(cause, "dataloader %r%s: %s", log_name(self.name), who, text)

    def at_iter(self, loader: Any) -> Wrap | None:
        """Before torch's iter(): the tuner's change, if the loader is tuned (tuner/loop.py).
        Returns what torch's __iter__ is to be wrapped in for the pool it rebuilt or
        kept, else None."""
        self.rec.workers.loop.tid = threading.get_native_id()
        if self.tuning is None:
            if self._tune_checked:
                return None
            self._tune_checked = True
            try:
                if not (self.tune or self.persist or envsettings.from_env()):
                    return None  # nothing to tune
                knobs = tuple(dict.fromkeys(self.tune + envsettings.auto_for(self.name)))
                wish = envsettings.persistent_wish(self.name) or self.persist
            except SettingsError:  # said where the loader was built
                knobs, wish = self.tune, self.persist
            if not knobs:
                return None
            if not isinstance(loader, torch.utils.data.DataLoader):
                envsettings.once.problem(
                    f"tune-kind:{self.name}", "dataloader %r: %s is not tuned: the tuner sets "
                    "a torch DataLoader's settings only", log_name(self.name),
                    type(loader).__qualname__)
                return None
            try:
                from .tuner.loop import LoaderTuning

                self.tuning = LoaderTuning(self.name, knobs, loader, self.rec, wish)
            except Exception:  # the tuner must never stop training
                log.warning("dataloader %r: the tuner cannot start; the loader keeps its "
                            "settings", log_name(self.name), exc_info=True)
                return None
        return self.tuning.at_iter(loader, self.forget_workers)

    @property
    def tuning_now(self) -> bool:
        """Whether a tuner is still judging this loader's epochs (not settled)."""
        return self.tuning is not None and not self.tuning.tuner.stable

    def probe_at(self, it: Any) -> int:
        """For a tuned loader: the first batch count at which its figures are read in the
        loop (probed), so that the epoch's last reading is taken while its workers live
        (torch ends a non-persistent pool before its iterator raises StopIteration) and
        no measurement is dropped unread in a long epoch (recorder.MAX_UNREAD): after 8,
        16, 32, ... batches, then every PROBE_EVERY, and at the next-to-last batch when
        the epoch's length is known."""
        start = self._probe_start = self.rec.batches
        try:
            n: int | None = len(it)
        except Exception:  # no length
            n = None
        self._probe_last = start + n - 1 if n is not None and n >= 2 else None
        return self._next_probe(start)

    def _next_probe(self, at: int) -> int:
        fine = self.tuning is not None and self.tuning.midepoch
        step = 8 if fine else min(max(8, at - self._probe_start), PROBE_EVERY)
        last = self._probe_last
        if last is None:
            return at + step
        return 0 if at >= last else min(at + step, last)

    def probed(self, at: int) -> int:
        """A probe_at count was reached: the loader's figures read now; the next count.
        A loader tuned in windows mid-epoch is probed every 8 batches, its figures read
        at most every FINE_READ seconds (and at the next-to-last batch)."""
        now = time.monotonic()
        if (self.tuning is None or not self.tuning.midepoch or at == self._probe_last
                or now - self._read_at >= FINE_READ):
            self._read_at = now
            self._read()
        return self._next_probe(at)

    def _read(self) -> None:
        """The tuner's reading of the loader's figures, its workers' past their interval.
        Never raises into the loop but torch's word that a worker died."""
        try:
            self.rec.flush(force=True)
        except Exception as e:
            reraise_torch_worker_error(e)
            log.debug("the tuner's reading failed", exc_info=True)

    def forget_workers(self) -> None:
        """The tracked pool was shut down on purpose (the tuner rebuilds it)."""
        if self._last_gen:
            self.rec.workers.stop(self._last_gen)
            self._last_gen = 0
        self._last_it = None

    def start_epoch(self, loader: Any, again: bool = False) -> None:
        """At iter(): the loader's settings. The epoch itself starts at its first batch (a
        framework may call iter() to probe a loader and fetch nothing). again: the same
        iter() planned anew (the tuner undid or resumed a change), not one more."""
        inputs = LoaderConfig.inputs(loader)
        rec = self.rec
        shm = process_shm_size()  # the trainer's own, which a doctor elsewhere cannot see
        made = rec.made  # the last loader of the name's: equal settings, the same objects
        if made is None or made[0] != inputs or made[2] != shm:
            config = made[1] if made is not None and made[0] == inputs else \
                LoaderConfig.from_inputs(inputs)
            made = rec.made = (inputs, config, shm, {
                "loader": self.name, "rank": rec.rank, **config.labels(),
                "dev_shm_bytes": shm})
        self.config = made[1]
        self._made = made
        self.mark_epoch(made[3], self.config.num_workers == 0, again)

    def mark_epoch(self, labels: dict[str, str], no_workers: bool, again: bool = False) -> None:
        """At iter(), on the recorder it may share with loaders of its name: one iteration
        more (unless again), this loader's labels (read-only to their readers,
        loader_collector.py) and failure report, and no workers to wait for if it has
        none."""
        rec = self.rec
        if not again:
            rec.iters += 1
        workers = rec.workers
        if getattr(workers.report, "__self__", None) is not self:
            workers.report = self.failed  # failures are said with this loader's settings
        rec.config = labels
        if no_workers:
            workers.blind = False
            if workers.active is None:
                workers.active = 0

    def tracking(self, it: Any) -> bool:
        """Whether `it` is the iterator whose workers are tracked already (persistent)."""
        last = self._last_it() if self._last_it is not None else None
        return last is not None and last is it

    def before_pool(self, loader: Any) -> None:
        """Before torch's iter() starts new workers: the last epoch's pool, unless
        persistent, ended on purpose, and the tracker prepared (WorkerTracker.prepare).
        numpy.random is imported here once: each torch worker seeds it, and a forked
        worker whose trainer never imported it imports it itself (a few ms of each
        worker's start, in every epoch of a pool that is not persistent). Before the
        loader's first pool, its dataset's containers of Python objects, which the
        workers will copy as they read them (cowscan.py), unless a loader of its name
        found them in the same dataset object already."""
        if "numpy.random" not in sys.modules:
            import numpy.random  # noqa: F401
        if not self.scanned:
            self.scanned = True
            try:
                rec, dataset = self.rec, loader.dataset
                if rec.scanned is None or rec.scanned() is not dataset:  # else found already
                    from .cowscan import scan
                    from .hotpath.workerblock import start_method

                    if start_method(loader) == "fork":  # else no copy-on-read to name
                        rec.dataset_objects = scan(dataset)
                    with contextlib.suppress(TypeError):
                        rec.scanned = weakref.ref(dataset)
            except Exception:  # looking must never stop training
                log.debug("the dataset scan failed", exc_info=True)
        workers = self.rec.workers
        if self._last_gen and not self.config.persistent_workers:
            workers.stop(self._last_gen)
            self._last_gen = 0
        workers.prepare()

    def track(self, it: Any, block: Block | None) -> int:
        """Tracks the workers of a new iterator until it is collected; 0 when there are none."""
        if self._last_it is not None and self.tracking(it):
            return self._last_gen
        workers = self.rec.workers
        if self._last_gen and not self.config.persistent_workers:
            workers.stop(self._last_gen)  # a new epoch: torch shuts the old ones down on purpose
            self._last_gen = 0
        pids = compat.worker_pids(it)
        if block is None and not pids:
            # Workers we cannot see (a loader that is not torch's) are unknown, not 0.
            workers.blind = self.config.num_workers != 0
            return 0
        workers.blind = False
        try:
            ref = self._last_it = workers.start(it, block, pids)
        except TypeError:  # cannot tell when it goes away, so its workers are not tracked
            self._last_it = None
            return 0
        self._last_gen = ref.key
        return ref.key

    def first_batch(self, batch: Any, since_iter_ns: int) -> None:
        rec = self.rec
        rec.first.append(since_iter_ns)
        tuning = self.tuning
        if tuning is not None and not tuning.tuner.stable:  # tuning_now: the workers' first
            self._read()  # sample of the epoch (tuner/loop.py)
            tuning = self.tuning
        self.iterated = True
        self.epochs += 1
        rec.epochs += 1
        try:
            if tuning is not None or not self.preflight.settled(self.config, self.epochs):
                self.preflight.on_iter(self.config, self.epochs, tuning is not None and
                                       "num_workers" in tuning.tuned and not tuning.advice_only,
                                       tuning is not None and tuning.keeping.mode != "torch")
        except Exception:  # advice must never stop training
            log.debug("preflight failed", exc_info=True)
        try:
            # Sampled here while unknown, and for the /dev/shm check, which only workers
            # need; else every hotpath/iterator.BYTES_EVERY batches, across epochs.
            if self.config.num_workers:
                rec.batch_bytes = batch_nbytes(batch)
                self.preflight.on_first_batch(self.config, rec.batch_bytes)
            elif rec.batch_bytes <= 0:
                rec.batch_bytes = batch_nbytes(batch)
        except Exception as e:
            reraise_torch_worker_error(e)
            log.debug("first-batch preflight failed", exc_info=True)

    def end(self, gen: int) -> None:
        """The iterator is exhausted (StopIteration)."""
        tuning = self.tuning
        if tuning is not None and not tuning.tuner.stable:  # tuning_now: the workers' last
            self._read()  # figures, before they stop
        if gen and not self.config.persistent_workers:
            self.rec.workers.stop(gen)  # torch has shut these workers down on purpose
        self.hub.flush_now()

    def error(self, exc: BaseException, it: Any, count: bool = True) -> None:
        """The iterator `it` raised `exc` (the loop may catch it and go on): a worker gone
        now is lost, the failure is counted by its cause, and the snapshot is written
        (by the writer's thread, waited for up to WAIT_WRITE) before the exception goes on
        to the loop: for every worker's death and /dev/shm failure, and for the first
        error of the dataset (one that raises again and again costs nothing more). count
        False: a holder's inner loader, whose holder counts the exception."""
        self.iterated = True  # it was: a failed first batch is no framework's rebuild
        workers = self.rec.workers
        death = failure_causes.deaths_in(exc)
        workers.refresh(0.0, on_error=True, named=dict.fromkeys(*death) if death else None,
                        exits=lambda pid: from_exitcode(compat.worker_exitcode(it, pid)))
        if not count:
            return
        cause = None if death else failure_causes.cause_of_error(
            exc, self.config.num_workers or 0)
        if cause is not None:
            workers.fail(cause, None, failure_causes.first_line(exc))
        if death or cause == failure_causes.SHM or (cause is not None and
                                               cause not in self._urgent_once):
            if cause is not None:  # a dataset raising again and again waits once
                self._urgent_once.add(cause)
            self.hub.write_soon(wait=WAIT_WRITE)

    def note_gpu(self, uuid: str) -> None:
        """Labels dataloader_info with the GPU this loader's batches go to."""
        self.rec.gpu_uuid = uuid

    # Moves a (nested) batch to a device, timed: per batch, so in hotpath/transfer.py.
    to_device = timed_to_device


def reraise_torch_worker_error(e: Exception) -> None:
    """A dead worker's error torch raised in our bookkeeping goes on to the loop."""
    if failure_causes.is_torch_worker_error(e):
        raise e
