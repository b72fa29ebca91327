"""The configuration line and the once-only warnings a loader gets on first use.

Logged through the "instrument" logger (never warnings.warn: a test run with -W error
must not turn advice into a crash).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from dataloader_exporter.core import advisor
from dataloader_exporter.core.bands import SHM_SAFETY, shm_in_flight, shm_size_advice
from dataloader_exporter.core.facts.shm import SHM_PATH, ShmSpace, shm_space
from dataloader_exporter.core.logonce import LogOnce
from dataloader_exporter.core.settings import log_name

from .rank import human_bytes, local_world_size

log = logging.getLogger("dataloader_exporter.instrument")


@dataclass(frozen=True)
class LoaderConfig:
    """The effective settings of a DataLoader (None where the loader has no such knob)."""

    num_workers: int | None
    batch_size: int | None
    prefetch_factor: int | None
    pin_memory: bool | None
    persistent_workers: bool | None

    @classmethod
    def of(cls, loader: Any) -> LoaderConfig:
        """The loader's settings; the batch size read from its batch sampler when the loader
        has none of its own (Accelerate shards through a batch sampler)."""
        return cls.from_inputs(cls.inputs(loader))

    @staticmethod
    def inputs(loader: Any) -> tuple[Any, ...]:
        """The loader attributes its config is made of (from_inputs): the same objects
        again mean the same config."""
        batch_size = getattr(loader, "batch_size", None)
        return (getattr(loader, "num_workers", None), getattr(loader, "prefetch_factor", None),
                batch_size, getattr(loader, "pin_memory", None),
                getattr(loader, "persistent_workers", None),
                getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
                if batch_size is None else None)

    @classmethod
    def from_inputs(cls, inputs: tuple[Any, ...]) -> LoaderConfig:
        """The config made of inputs(loader)."""
        num_workers, prefetch, batch_size, pin_memory, persistent, sampled = inputs
        if prefetch is None and num_workers:
            prefetch = 2  # torch's default when workers are used
        if batch_size is None and isinstance(sampled, int) and not isinstance(
                sampled, bool) and sampled > 0:
            batch_size = sampled
        return cls(num_workers, batch_size, prefetch, pin_memory, persistent)

    def labels(self) -> dict[str, str]:
        def s(v: object) -> str:
            if v is None:
                return ""
            return str(v).lower() if isinstance(v, bool) else str(v)

        return {"num_workers": s(self.num_workers), "batch_size": s(self.batch_size),
                "prefetch_factor": s(self.prefetch_factor), "pin_memory": s(self.pin_memory),
                "persistent_workers": s(self.persistent_workers)}


def shm_needed(batch_bytes: int, cfg: LoaderConfig, local_ranks: int = 1) -> int:
    """Shared memory the loader's in-flight batches may need, with a 1.5x margin."""
    return int(shm_in_flight(batch_bytes, cfg.prefetch_factor or 2, cfg.num_workers or 0,
                             local_ranks))


CPU_FACTS_TTL = 60.0  # seconds the process's CPU facts are reused across loaders
_cpu_facts: tuple[float, advisor.Cpu] | None = None


def process_cpu() -> advisor.Cpu:
    """advisor.local_cpu(), read at most every CPU_FACTS_TTL seconds for the whole
    process: its sysfs and cgroup reads cost more than building a short-lived loader."""
    global _cpu_facts
    now = time.monotonic()
    facts = _cpu_facts
    if facts is None or now - facts[0] > CPU_FACTS_TTL:
        facts = _cpu_facts = (now, advisor.local_cpu())
    return facts[1]


SHM_SIZE_TTL = 60.0  # seconds the size of /dev/shm is reused across iter()s and loaders
# Seconds between two checks of /dev/shm's free space for the same settings and batch size
# (a short-lived pool's first batch comes every few milliseconds).
SHM_FREE_EVERY = 1.0
_shm_size: tuple[float, str] | None = None


def process_shm_size() -> str:
    """The size of the trainer's /dev/shm in bytes as a label value ("" when unknown),
    read at most every SHM_SIZE_TTL seconds for the whole process: a mount's size does
    not change with each iter(), and statvfs costs more than the rest of it."""
    global _shm_size
    now = time.monotonic()
    got = _shm_size
    if got is None or now - got[0] > SHM_SIZE_TTL:
        shm = shm_space(SHM_PATH)
        got = _shm_size = (now, str(shm.size) if shm else "")
    return got[1]


def _cuda_available() -> bool:
    """Whether this process can see a GPU (the loop then needs no core of its own)."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


T = TypeVar("T")


class _Once(Generic[T]):
    """A function of no arguments called at its first use only; its result kept (what
    functools.cache gives, at a fraction of its cost to make: one per loader built)."""

    __slots__ = ("fn", "value")

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn: Callable[[], T] | None = fn
        self.value: T | None = None

    def __call__(self) -> T:
        if self.fn is not None:
            self.value, self.fn = self.fn(), None
        return self.value  # type: ignore[return-value]  # set above


class Preflight:
    """Logs a loader's configuration once and each piece of advice at most once: one per
    loader name (Instruments shares it among the loaders of a name, as their series are)."""

    def __init__(self, name: str, shm_path: str = SHM_PATH,
                 shm_probe: Callable[[str], ShmSpace | None] = shm_space,
                 cpu: Callable[[], advisor.Cpu] = process_cpu,
                 local_ranks: Callable[[], int] = local_world_size,
                 cuda: Callable[[], bool] = _cuda_available) -> None:
        self.name = name
        self.shm_path = shm_path
        self._shm_probe = shm_probe
        # psutil and cgroup files are read once per loader: cores do not change mid-run.
        self._cpu = _Once(cpu)
        self._local_ranks = _Once(local_ranks)
        self._cuda = _Once(cuda)
        self._config_line = LogOnce(log, logging.INFO)  # the configuration line
        self._advice = LogOnce(log)  # each piece of advice
        # The config (and tuned_workers) whose advice on_iter gave: only the epoch's is left.
        self._checked: LoaderConfig | None = None
        self._checked_tuned = False
        # on_first_batch's last check of /dev/shm: (time.monotonic(), config, batch bytes).
        self._shm_checked: tuple[float, LoaderConfig, int] | None = None

    def _warn(self, key: str, msg: str, *args: object) -> None:
        if not self._advice.seen(key):
            self._advice.problem(key, "dataloader %r: " + msg, log_name(self.name), *args)

    def settled(self, cfg: LoaderConfig, epoch: int) -> bool:
        """Whether on_iter(cfg, epoch), untuned, has nothing left to do or say: cfg was
        checked already, and no word on persistent_workers is due (none without workers,
        before a loader's second epoch or with persistent ones)."""
        return (self._same(cfg) and self._checked_tuned is False
                and (not cfg.num_workers or epoch < 2 or cfg.persistent_workers is not False))

    def _same(self, cfg: LoaderConfig) -> bool:
        """Whether cfg is (of equal values to) the config checked last: a short-lived
        loader of the name with the same settings has nothing new to check."""
        return cfg is self._checked or cfg == self._checked

    def on_iter(self, cfg: LoaderConfig, epoch: int, tuned_workers: bool = False,
                tuned_persistent: bool = False) -> None:
        """At each iter(): the config line (first time) and config-only advice. The loader's
        epoch counts its own epochs; tuned_workers: the tuner sets num_workers from what it
        measures, so no advice is given on the count; tuned_persistent: it also decides
        persistent_workers (tuner/keep.py), so none on that either."""
        if self._same(cfg) and tuned_workers is self._checked_tuned:
            if (epoch >= 2 and cfg.persistent_workers is False and cfg.num_workers
                    and not tuned_persistent):
                self._warn("not-persistent", "persistent_workers=False restarts %d workers "
                           "at every epoch, stalling its first batch; set "
                           "persistent_workers=True", cfg.num_workers)
            return  # the rest was checked for this config already
        self._checked, self._checked_tuned = cfg, tuned_workers
        if not self._config_line.seen("config") and not log.isEnabledFor(logging.INFO):
            self._config_line.problem("config", "")  # said, at a level nobody logs
        if not self._config_line.seen("config"):
            shm = self._shm_probe(self.shm_path)
            self._config_line.problem(
                "config", "dataloader %r: num_workers=%s prefetch_factor=%s pin_memory=%s "
                "persistent_workers=%s batch_size=%s; %s, local ranks=%d, %s size=%s",
                log_name(self.name), cfg.num_workers, cfg.prefetch_factor, cfg.pin_memory,
                cfg.persistent_workers, cfg.batch_size, self._cpu().describe(),
                self._local_ranks(), self.shm_path, human_bytes(shm.size) if shm else "unknown")
        said = self._advice.seen
        if said("no-workers") and said("too-many-workers") and said("not-persistent"):
            return
        cpu, ranks = self._cpu(), self._local_ranks()
        if tuned_workers:
            pass
        elif cfg.num_workers == 0 and not said("no-workers"):
            self._warn("no-workers", "num_workers=0 loads every batch in the training "
                       "process, so the GPU waits while it does; try num_workers=%d (%s "
                       "shared by %d local rank%s)",
                       advisor.worker_cap(cpu, ranks, self._cuda()), cpu.describe(), ranks,
                       "" if ranks == 1 else "s")
        elif (cfg.num_workers and not said("too-many-workers") and
              advisor.too_many_workers(cfg.num_workers, cpu, ranks)):
            # No smaller count: workers that wait on storage need no core each, and which
            # these are is measured only once they run (the doctor, num_workers=auto).
            self._warn("too-many-workers", "num_workers=%d x %d local rank%s exceeds the %s "
                       "this process may use: workers that run on a CPU will fight for it "
                       "with each other and the training loop (%d of them get a core each), "
                       "while workers that wait on storage or the network need none; which "
                       "these are is not known before they run (`dataloader-exporter doctor` "
                       "measures it, num_workers=auto sets the count from it)",
                       cfg.num_workers, ranks, "" if ranks == 1 else "s", cpu.describe(),
                       advisor.worker_cap(cpu, ranks, self._cuda()))
        if epoch >= 2 and cfg.num_workers and cfg.persistent_workers is False:
            self.on_iter(cfg, epoch, tuned_workers, tuned_persistent)  # the not-persistent advice

    def on_cuda_transfer(self, cfg: LoaderConfig) -> None:
        if cfg.pin_memory is False:
            self._warn("no-pin", "batches go to CUDA but pin_memory=False, so each copy is "
                       "synchronous and cannot overlap compute; set pin_memory=True")

    def on_first_batch(self, cfg: LoaderConfig, batch_bytes: int) -> None:
        """After the first batch: will in-flight batches overflow /dev/shm? Checked again
        for the same settings and batch size once SHM_FREE_EVERY seconds have passed."""
        if not cfg.num_workers or batch_bytes <= 0 or self._advice.seen("shm"):
            return
        now = time.monotonic()
        last = self._shm_checked
        if (last is not None and now - last[0] < SHM_FREE_EVERY and last[2] == batch_bytes
                and (last[1] is cfg or last[1] == cfg)):  # the same object, mostly (rec.made)
            return
        self._shm_checked = (now, cfg, batch_bytes)
        shm = self._shm_probe(self.shm_path)
        ranks = self._local_ranks()  # every local rank's workers share the machine's shm
        need = shm_needed(batch_bytes, cfg, ranks)
        if shm is None or need <= shm.free:
            return
        self._warn("shm", "batches of %s x prefetch_factor %d x %d workers x %d local "
                   "ranks x %.1f = %s of "
                   "shared memory, but %s has only %s free (of %s): workers will die with "
                   "a bus error or 'Killed'. Give the container more shared memory "
                   "(docker run --shm-size=%s; Kubernetes: a memory-backed emptyDir at "
                   "/dev/shm) or lower num_workers, prefetch_factor or the batch size",
                   human_bytes(batch_bytes), cfg.prefetch_factor or 2, cfg.num_workers,
                   ranks, SHM_SAFETY, human_bytes(need), shm.path, human_bytes(shm.free),
                   human_bytes(shm.size), shm_size_advice(need))
