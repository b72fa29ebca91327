"""The workers' private memory grows: by how much, from what, and how long the room lasts.

NOTE [ copy-on-read ]
A dataset that holds its index as Python objects (a list of 3,000,000 path strings, a
dict of labels) is shared with forked workers copy-on-write, and every read of an item
writes its reference count: each worker copies the pages of the items it reads, so its
private memory (USS) grows until it has read them all, by about the container's size per
worker. The commonest way a DataLoader job dies is this growth, hours in, under a
container's memory limit. The trainer exports how fast the workers' private memory grows
(catalogue.WORKER_PRIVATE_GROWTH, summed over the live workers) and the largest container
it found among the dataset's attributes (catalogue.DATASET_OBJECTS: its estimated bytes,
its item count a label). The doctor names the growth once it reaches GROWTH_PER_WORKER
per worker, and calls it copy-on-read only where a container was found; the fix is an
array that holds no Python object per item (numpy, pyarrow, a tensor), which every worker
shares. Growth under the threshold or not measured says nothing, and neither does a
container whose workers do not grow (already copied, or not read): nothing is drawn from
a missing figure. The one exception is a worker the OOM killer ended (oom_words): there
the container is named as what the dataset holds, not as a cause seen.
"""

from __future__ import annotations

from dataloader_exporter.core.copyonread import remedy
from dataloader_exporter.diagnosis.signals import LoaderSignals
from dataloader_exporter.diagnosis.units import gib
from dataloader_exporter.diagnosis.workersignals import DatasetContainer

MiB = float(1 << 20)
# bytes/s per worker: 1 MiB a minute, 1.4 GiB a day. A worker that holds steady moves by
# less between the trainer's median readings (the batch in hand, allocator arenas); a
# 3,000,000-path list (about 0.3 GiB) copied over a one-hour epoch grows 5 MiB a minute.
GROWTH_PER_WORKER = MiB / 60
KIND = "memory-growth"
# The room the projection is against, by memory_room's source (no reserve kept).
_ROOM = {"trainer": "the trainer's container has left (its least while the workers ran)",
         "cgroup": "left under the container's memory limit",
         "host": "of the host's available memory"}


def workers_counted(s: LoaderSignals) -> float | None:
    """The workers the growth is divided among: those alive now, else the configured ones
    (the growth is kept after they end); None when neither is known."""
    return s.workers_active or s.workers_configured or None


def per_worker(s: LoaderSignals) -> float | None:
    """bytes/s each worker's private memory grows; None when not measured."""
    growth, n = s.workers.private_growth, workers_counted(s)
    return None if growth is None or not n else growth / n


def seen(s: LoaderSignals) -> bool:
    """Whether the workers' private memory grows GROWTH_PER_WORKER each or faster."""
    rate = per_worker(s)
    return rate is not None and rate >= GROWTH_PER_WORKER


def per_minute(rate: float) -> str:
    return f"{rate * 60 / MiB:.1f} MiB a minute"


def largest(s: LoaderSignals) -> DatasetContainer | None:
    """The dataset's largest container (the one the trainer exports); None: none found."""
    return s.dataset_containers[0] if s.dataset_containers else None


def still_to_copy(s: LoaderSignals) -> float:
    """Bytes of the dataset's largest container a worker has yet to copy while its private
    memory is seen to grow (`seen`: slower growth is not told from noise): its estimated
    size less the worker's PSS now (all of which is counted as copied, so this errs low),
    or the whole size where PSS is not read; 0 without such growth, a container or its
    size."""
    c = largest(s)
    if c is None or c.bytes is None or not seen(s):
        return 0.0
    pss, live = s.workers.pss, s.workers_active
    return max(0.0, c.bytes - (pss / live if pss is not None and live else 0.0))


def seconds_left(s: LoaderSignals, room: tuple[float, str] | None) -> float | None:
    """Seconds until live workers growing at the measured rate fill `room` (bytes, and
    where it was read: why.memory_room with no reserve); None when a figure is missing,
    no worker is alive now or the run has ended (nothing is left to fill)."""
    rate = s.workers.private_growth
    if room is None or not rate or rate <= 0 or not s.workers_active or s.ended:
        return None
    return room[0] / rate


def duration(seconds: float) -> str:
    if seconds < 60:
        return "under a minute"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} days"


def what(c: DatasetContainer) -> str:
    """'a list of 3,000,000 str (~0.30 GiB)'."""
    count = f"{c.objects:,.0f} " if c.objects is not None else ""
    size = f" (~{gib(c.bytes)})" if c.bytes is not None else ""
    return f"a {c.container} of {count}{c.item}{size}"


def describe(c: DatasetContainer) -> str:
    """'`dataset.paths`, a list of 3,000,000 str (~0.30 GiB)'."""
    return f"`{c.attribute}`, {what(c)}"


def fix(c: DatasetContainer) -> str:
    """What to store the container as, so that no Python object per item is read."""
    return remedy(c.attribute, c.container, c.item)


def message(s: LoaderSignals, room: tuple[float, str] | None) -> str:
    """The memory-growth finding (for a loader where `seen`): the growth per worker, the
    dataset's largest container and the fix, or that none was found; the time the room
    lasts."""
    rate, n = per_worker(s) or 0.0, workers_counted(s) or 0.0
    who = f"{n:.0f} worker{'' if n == 1 else 's'}" + (
        "" if s.workers_active else " configured, none alive now")
    head = f"memory growth: the workers' private memory grows ~{per_minute(rate)} each ({who}"
    first = largest(s)
    if first is None:
        return (f"{head}), and the trainer named no large container of Python objects among "
                "the dataset's attributes (none where it looks, or it could not look): "
                "something else may accumulate in the workers (a cache the dataset fills, a "
                "leak), and each added worker would grow too"
                f"{_projection(s, room)}")
    return (f"{head}; copy-on-read): `{first.attribute}` is {what(first)} whose items' "
            "reference counts are written on every read, so each worker copies their pages, "
            f"and each added worker would copy them too; store it as {fix(first)}"
            f"{_projection(s, room)}")


def _projection(s: LoaderSignals, room: tuple[float, str] | None) -> str:
    """The time the room lasts at this rate; and where copy-on-read alone would stop
    within it (each worker copies about the container's size, at most once), that too."""
    left = seconds_left(s, room)
    if left is None or room is None:
        return ""
    text = (f"; at this rate the workers use up the {gib(room[0])} "
            f"{_ROOM.get(room[1], 'left')} in {'' if left < 60 else 'about '}{duration(left)}")
    c, live = largest(s), s.workers_active or 0.0
    size = c.bytes if c is not None else None
    if size and size * live < room[0]:
        text += (f"; if copy-on-read is all that grows, it stops sooner: each worker copies "
                 f"about the container's {gib(size)} once, {gib(size * live)} for the "
                 f"{live:.0f}")
    return text


def oom_words(s: LoaderSignals) -> tuple[str, str]:
    """For workers killed by the OOM killer: what their private memory's growth and the
    dataset's largest container say (appended to what was seen), and the fix to put
    first; two empty strings when neither growth nor a container is known. Without growth
    seen (not measured before the kill, already copied, or not read) the container is
    named as what the dataset holds, and its fix applies only if the workers read it."""
    grew, first = seen(s), largest(s)
    growth = (f"; the workers' private memory grew ~{per_minute(per_worker(s) or 0.0)} each"
              if grew else "")
    if first is None:
        if not grew:
            return "", ""
        return (f"{growth}, and the trainer named no large container of Python objects among "
                "the dataset's attributes (none where it looks, or it could not look): "
                "something else may accumulate in the workers (a cache the dataset fills, a "
                "leak)",
                "find what accumulates in the workers and bound it; then ")
    store = (f"store `{first.attribute}` as {fix(first)}, which the workers share rather "
             "than copy; then ")
    if grew:
        return (f"{growth}; copy-on-read: {describe(first)}, which every worker copies as it "
                "reads its items (their reference counts are written on every read)", store)
    return (f"; the dataset holds {describe(first)}, which each worker that reads its items "
            "copies, about its size each (copy-on-read: their reference counts are written "
            "on every read); whether they did is not known (their private memory was not "
            "seen to grow)",
            f"if the workers read it, {store}")


def top_line(s: LoaderSignals) -> str | None:
    """top's line under a loader's row where its workers' memory grows (see `seen`)."""
    if not seen(s):
        return None
    c = largest(s)
    cause = (f"copy-on-read: {describe(c)}" if c is not None
             else "no large container of Python objects named in the dataset")
    return (f"  {s.loader[:16]} rank {s.rank}: workers' private memory grows "
            f"{per_minute(per_worker(s) or 0.0)} each ({cause})")
