"""Whether the loader tuner keeps its worker pool across epochs (persistent_workers=auto).
Pure.

A pool that is not persistent starts again at every iter(): its workers fork (or spawn)
and import, and the epoch's first batch waits for them. Kept, that wait goes, but the
pool holds its memory between epochs (during validation, while another loader's pool
runs). So the tuner keeps it when both hold:

- worth it: the epoch's first batch, which waited for the new pool's start, took
  bands.MODERATE of the epoch's wall time or more (the share at which a wait for input is
  worth changing a setting, as the tuner's other rules judge it);
- room: the memory left with no pool holds the pool twice over: kept, it leaves room
  for another of its size (a validation loader's) between epochs. An unknown figure keeps
  nothing, as unknown figures block growth in the other rules.

The epoch whose pool is kept is then judged as the kept pool will run (as_kept): without
its start, which the epochs to come do not pay.
"""

from __future__ import annotations

from dataclasses import replace

from dataloader_exporter.core import bands
from dataloader_exporter.core.tuner.types import Budget, Epoch


def keep_pool(epoch: Epoch, budget: Budget) -> tuple[bool, str]:
    """(keep, why): whether to keep the pool that ran `epoch` from its next iter() on, and
    the figures that say so (for the log line)."""
    workers = epoch.setting.workers
    if workers <= 0 or epoch.start_share is None or epoch.start_s is None:
        return False, "no pool started at the epoch's iter()"
    wall = epoch.start_s / epoch.start_share if epoch.start_share > 0 else 0.0
    whose = "worker's" if workers == 1 else "workers'"
    start = (f"its {workers} {whose} start held the first batch "
             f"{epoch.start_s:.2f} s, {epoch.start_share:.0%} of a {wall:.2f} s epoch")
    if epoch.start_share < bands.MODERATE:
        return False, f"{start}: under {bands.MODERATE:.0%}"
    if epoch.worker_bytes is None or budget.memory_room is None:
        return False, f"{start}, but the memory the pool holds or the room left is unknown"
    held = workers * epoch.worker_bytes
    if budget.memory_room < 2 * held:
        return False, (f"{start}, but the {held >> 20} MiB it holds would leave less than "
                       f"that again of the {budget.memory_room >> 20} MiB left")
    return True, f"{start}; it holds {held >> 20} MiB of the {budget.memory_room >> 20} MiB left"


def as_kept(epoch: Epoch) -> Epoch:
    """`epoch` as its pool, kept, would have run it: its rate over its wall time less the
    pool's start (start_s), the other figures as measured; `epoch` itself where no start
    was measured."""
    share = epoch.start_share
    if epoch.start_s is None or share is None or not 0 < share < 1:
        return epoch
    return replace(epoch, samples_per_s=epoch.samples_per_s / (1 - share))
