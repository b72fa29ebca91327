"""Nothing the instrumentation takes outlives its loader: shared-memory blocks,
descriptors, threads. Loaders are built without a registry, as a user builds them, and
bare torch goes through the same steps first, so what torch itself keeps (a few cached
shared-memory descriptors) is part of the baseline."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import Any

import pytest
from support.helpers import deadline_poll
from support.torch_helpers import SleepDataset
from torch.utils.data import DataLoader as TorchDataLoader

from dataloader_exporter import instrument

pytestmark = [pytest.mark.torch, pytest.mark.slow]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def back_to(fds: int, threads: int) -> Callable[[], bool]:
    def check() -> bool:
        gc.collect()
        return open_fds() <= fds and os_threads() <= threads

    return check


def one_pass(cls: Any, persistent: bool, stop_after: int | None = None, **kw: Any) -> None:
    """A loader built for one pass (an evaluation, say), then dropped."""
    loader = cls(SleepDataset(4), batch_size=1, num_workers=1, persistent_workers=persistent,
                 **kw)
    for i, (_, y) in enumerate(loader):
        assert int(y) == i
        if i == stop_after:
            break


@pytest.mark.timeout(600)  # each loader forks a worker from a big process: slow under load
def test_hundreds_of_short_lived_loaders_with_a_worker_leave_nothing_behind() -> None:
    for persistent in (False, True):  # what bare torch and a first loader of a name keep
        one_pass(TorchDataLoader, persistent)
        one_pass(instrument.DataLoader, persistent, name="eval")
    gc.collect()
    fds, threads = open_fds(), os_threads()
    for i in range(300):  # a leak of one descriptor or thread per loader shows as 300
        one_pass(instrument.DataLoader, persistent=bool(i % 2), name="eval")
        if i % 100 == 99:
            assert deadline_poll(back_to(fds, threads), 10), (i, open_fds(), fds,
                                                              os_threads(), threads)


def test_iterators_abandoned_mid_epoch_release_their_blocks_and_workers() -> None:
    for persistent in (False, True):
        for cls, kw in ((TorchDataLoader, {}), (instrument.DataLoader, {"name": "eval"})):
            one_pass(cls, persistent, stop_after=1, **kw)
    gc.collect()
    fds, threads = open_fds(), os_threads()
    for i in range(40):
        one_pass(instrument.DataLoader, bool(i % 2), stop_after=1, name="eval")
    assert deadline_poll(back_to(fds, threads), 10), (open_fds(), fds, os_threads(), threads)
