"""Nothing the instrumentation takes outlives its loader: shared-memory blocks,
descriptors, threads (a loader name keeps one block, a page, for its next pool). Loaders
are built without a registry, as a user builds them, and bare torch goes through the same
steps first, so what torch itself keeps (a few cached shared-memory descriptors) is part
of the baseline."""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
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


def _gone_pid() -> int:
    """The pid of a child that has exited and been reaped."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


class _Iterator:  # stands in for torch's iterator: the tracker holds a weak reference
    pass


def test_a_names_next_pool_takes_the_last_blocks_only_once_its_workers_are_gone() -> None:
    """A folded generation's block (an anonymous mapping for forked workers) is given to
    the next pool, zeroed, only when no process that shared it exists any more, no one
    else holds it, and it has the new pool's number of rows; otherwise it is released."""
    from dataloader_exporter.instrument.hotpath.workerblock import new_block
    from dataloader_exporter.instrument.worker_tracker import WorkerTracker

    def folded(pids: list[int], rows: int = 2, held: list[Any] | None = None) -> Any:
        tracker = WorkerTracker()
        block = new_block(rows, forked=True)
        block.fill(pids[0])  # what the last pool's workers wrote (their pid, too)
        if held is not None:
            held.append(block)
        it = _Iterator()
        tracker.start(it, block, pids)
        ref = weakref.ref(block)
        del it, block  # the iterator collected: its generation is folded at the next call
        return tracker, ref

    gone = _gone_pid()
    tracker, ref = folded([gone])
    taken = tracker.take_block(2)
    assert taken is not None and taken is ref() and not taken.any()
    assert tracker.take_block(2) is None  # given once

    tracker, ref = folded([gone, os.getpid()])  # one of them still exists
    assert tracker.take_block(2) is None and ref() is None  # released

    tracker, ref = folded([gone], rows=3)
    assert tracker.take_block(2) is None and ref() is None

    held: list[Any] = []
    tracker, ref = folded([gone], held=held)  # someone else still reads it
    assert tracker.take_block(2) is None and ref() is held[0] and (held[0] == gone).all()


def test_short_lived_loaders_of_a_name_count_each_workers_samples_once_through_one_block(
        ) -> None:
    """Loaders of one name built for one pass each: from the second on, the pool takes the
    last one's block, and each worker's samples are still counted once per pass, as torch
    hands them out (batches alternate between the two workers)."""
    from torch.utils.data import TensorDataset

    dataset = TensorDataset(torch.arange(64))
    blocks = []
    for n in range(3):
        loader = instrument.DataLoader(dataset, batch_size=8, num_workers=2,
                                       multiprocessing_context="fork", name="one-pass")
        it = iter(loader)
        blocks.append(weakref.ref(it._collate_fn.block))
        assert [b[0].tolist() for b in it] == [list(range(i, i + 8)) for i in range(0, 64, 8)]
        if n:
            assert blocks[n]() is blocks[0]()
        del it
    workers = loader._instruments.rec.workers.per_worker()
    assert [(w, s) for w, _, s, _ in workers] == [(0, 96), (1, 96)], workers
