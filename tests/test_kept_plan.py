"""An epoch whose plan is kept from the last iter() (iter_start._kept_iter, a loader
without workers or tuner whose settings did not change): the same batches as torch's own
loader, and the same counts, epochs, first-batch waits and full-batch arming as a loader
planned anew at every iter(), for every kind of batch. And nothing in an epoch's start
asks for the loader's __dict__, which would slow torch's own iter()."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from support.helpers import value
from torch.utils.data import Dataset, TensorDataset

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.instrument import iter_start
from dataloader_exporter.instrument.hotpath.iterator import BYTES_EVERY, TimedIterator

pytestmark = pytest.mark.torch

L = {"loader": "t", "rank": "0"}


class Resized(Dataset[Any]):
    """A dataset whose length the test changes between epochs; item i is make(i)."""

    def __init__(self, n: int, make: Callable[[int], Any]) -> None:
        self.n, self.make = n, make

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.make(i)


def _pair(i: int) -> tuple[torch.Tensor, int]:
    return torch.full((3,), float(i)), i


def _record(i: int) -> dict[str, torch.Tensor]:
    return {"x": torch.tensor([i, i]), "y": torch.tensor(i)}


def _tensor(i: int) -> torch.Tensor:
    return torch.tensor([float(i)])


def _named(i: int) -> tuple[str, torch.Tensor]:  # a column of strings first: Python counts it
    return f"s{i}", torch.tensor(i)


# (item, loader arguments, the dataset's length at each epoch)
CASES = {
    "tuple": (_pair, {"batch_size": 4}, [30, 30, 30, 30]),
    "dict-shuffled": (_record, {"batch_size": 5, "shuffle": True}, [23, 23, 23]),
    "tensor-drop-last": (_tensor, {"batch_size": 4, "drop_last": True}, [18, 18, 18]),
    "grows-and-shrinks": (_pair, {"batch_size": 4}, [30, 41, 9, 30, 3]),
    "one-batch": (_pair, {"batch_size": 64}, [10, 10, 10]),
    "strings-first": (_named, {"batch_size": 4}, [14, 14, 14]),
}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return type(a) is type(b) and torch.equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def _run(case: str, keep: bool, monkeypatch: pytest.MonkeyPatch,
         registry: CollectorRegistry) -> tuple[list[Any], int, int]:
    """Each epoch of the case side by side with torch's loader (the same batches, asserted);
    what the instrumented loader's recorder holds after each epoch; the iter()s taken by a
    kept plan, and the first batches recorded. keep=False: a plan is never kept."""
    make, kwargs, lengths = CASES[case]
    data = Resized(lengths[0], make)
    shuffled = kwargs.get("shuffle", False)
    gens = [torch.Generator().manual_seed(3) for _ in range(2)] if shuffled else [None, None]
    bare = torch.utils.data.DataLoader(data, generator=gens[0], **kwargs)
    ours = instrument.DataLoader(data, name="t", registry=registry, generator=gens[1],
                                 **kwargs)
    kept_iters, firsts = [0], [0]
    made = iter_start._kept_iter

    def kept_iter(*args: Any) -> Any:
        timed = made(*args)
        kept_iters[0] += timed is not None
        return timed

    first = TimedIterator._first

    def counted_first(self: TimedIterator, batch: Any, t1: int) -> Any:
        firsts[0] += 1
        return first(self, batch, t1)

    monkeypatch.setattr(iter_start, "_kept_iter", kept_iter)
    monkeypatch.setattr(TimedIterator, "_first", counted_first)
    if not keep:
        monkeypatch.setattr(iter_start._Kept, "of", classmethod(lambda cls, *a: None))
    states = []
    rec = ours._instruments.rec
    for n in lengths:
        data.n = n
        got, want = list(ours), list(bare)
        assert len(got) == len(want) and all(map(_same, got, want))
        samples = sum(len(b["y"] if type(b) is dict else b[1] if type(b) is list else b)
                      for b in want)
        exported = value(registry, cat.SAMPLES.name, **L)  # a scrape: the rings are read
        states.append((rec.batches, rec.samples, rec.samples_known, rec.epochs, rec.iters,
                       ours._instruments.epochs, int(rec.first_h.counts.sum()),
                       rec.first_at_ns > 0, exported, samples, len(want)))
    return states, kept_iters[0], firsts[0]


@pytest.mark.parametrize("case", list(CASES))
def test_a_kept_plan_records_an_epoch_as_a_plan_made_anew(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kept_reg, planned_reg = CollectorRegistry(), CollectorRegistry()
    with monkeypatch.context() as m:
        states, kept, firsts = _run(case, True, m, kept_reg)
    with monkeypatch.context() as m:
        planned, never, planned_firsts = _run(case, False, m, planned_reg)
    assert states == planned, (states, planned)
    epochs = len(CASES[case][2])
    # The first epoch is planned; each later one is kept. One first batch an epoch, each
    # through the one Python path.
    assert (kept, never) == (epochs - 1, 0)
    assert firsts == planned_firsts == epochs
    batches, samples, known, rec_epochs, iters, own_epochs, first_h, at, exported, _, _ = (
        states[-1])
    assert known and rec_epochs == iters == own_epochs == first_h == epochs and at
    assert exported == samples == sum(s[-2] for s in states)
    assert batches == sum(s[-1] for s in states)
    for name in (cat.BATCHES.name, cat.SAMPLES.name, cat.EPOCHS.name):
        assert value(kept_reg, name, **L) == value(planned_reg, name, **L)


def test_a_first_batch_due_for_its_bytes_samples_them(registry: CollectorRegistry) -> None:
    """A kept epoch's first batch that is the recorder's BYTES_EVERY-th batch samples the
    batch's bytes, as any such batch does; the full batches after it are not walked."""
    every = BYTES_EVERY
    loader = instrument.DataLoader(TensorDataset(torch.zeros(every - 1, 2)), batch_size=1,
                                   name="t", registry=registry)
    rec = loader._instruments.rec
    assert sum(len(b[0]) for b in loader) == every - 1
    rec.batch_bytes = 1  # what an earlier sample said; batch every is sampled anew
    it = iter(loader)
    assert loader._instruments.kept is not None
    next(it)
    assert rec.batches == every and rec.batch_bytes == 8
    rec.batch_bytes = 1
    assert sum(len(b[0]) for b in it) == every - 2
    assert rec.batch_bytes == 1 and rec.samples == 2 * (every - 1)


def _dicts(obj: object) -> int:
    """The dicts the collector sees an object refer to: its __dict__ is one of them only
    once something asked for it (CPython keeps the attributes inline until then)."""
    return sum(type(r) is dict for r in gc.get_referents(obj))


def test_an_epochs_start_leaves_the_loaders_dict_unasked(registry: CollectorRegistry) -> None:
    """Once asked for, a loader's __dict__ slows every later attribute read of torch's
    iter() (about 6,000 instructions an epoch start): the kept plan's checks read the
    loader's settings as getattr() does."""
    data = TensorDataset(torch.zeros(10, 2))
    loader = instrument.DataLoader(data, batch_size=4, name="t", registry=registry)
    before = _dicts(loader)
    for _ in range(3):
        assert len(list(loader)) == 3
    assert loader._instruments.kept is not None
    assert _dicts(loader) == before
    loader.__dict__  # noqa: B018  # what the test would see had an epoch asked for it
    assert _dicts(loader) == before + 1
