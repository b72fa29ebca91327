"""DataLoader subclasses of every shape, under zero-code mode with a settings line. argv: OUT.

Run once per rank (RANK=0 and RANK=1): rank 0 builds a probe loader first, through the
same helper as the training loader, so names must not depend on what was built before.
Each records what the loop took and what the loaders were set to.
"""

import itertools
import os
import sys
from typing import Any

import torch
from common import record, site
from torch.utils.data import DataLoader, TensorDataset


class Shuffled(DataLoader):  # type: ignore[type-arg]
    """__iter__ returns a generator that reaches torch's __iter__ only when it runs."""

    def __iter__(self) -> Any:
        return self._batches()

    def _batches(self) -> Any:
        yield from super().__iter__()


class Facade(DataLoader):  # type: ignore[type-arg]
    """Never calls torch's __init__; iterates other loaders."""

    def __init__(self, *loaders: DataLoader) -> None:  # type: ignore[type-arg]
        self.loaders = loaders

    def __len__(self) -> int:
        return sum(map(len, self.loaders))

    def __iter__(self) -> Any:
        return itertools.chain(*self.loaders)


class Pinned(DataLoader):  # type: ignore[type-arg]
    """Takes **kwargs and passes a setting of its own to torch's __init__."""

    def __init__(self, dataset: Any, **kwargs: Any) -> None:
        super().__init__(dataset, pin_memory=True, **kwargs)


class _Repeat:
    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __iter__(self) -> Any:
        while True:
            yield from iter(self.sampler)


class MultiEpochs(DataLoader):  # type: ignore[type-arg]
    """timm's MultiEpochsDataLoader: one torch iterator, started in __init__, for every
    epoch (so torch counts one epoch: epochs are iterators that gave a first batch)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._DataLoader__initialized = False
        self.batch_sampler = _Repeat(self.batch_sampler)  # type: ignore[assignment]
        self._DataLoader__initialized = True
        self.iterator = super().__iter__()

    def __len__(self) -> int:
        return len(self.batch_sampler.sampler)  # type: ignore[attr-defined]

    def __iter__(self) -> Any:
        for _ in range(len(self)):
            yield next(self.iterator)


def data(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(float(n)))


def make(n: int) -> DataLoader:  # type: ignore[type-arg]
    return DataLoader(data(n), batch_size=2)


def count(loader: Any, epochs: int = 1) -> tuple[int, int]:
    batches = [b for _ in range(epochs) for b in loader]
    return len(batches), sum(len(b[0]) for b in batches)


if os.environ.get("RANK") == "0":
    probe = make(4); probe_at = site()  # noqa: E702
    count(probe)
train = make(16); train_at = site()  # noqa: E702
seen = {"train": [train_at, *count(train)]}
lazy = Shuffled(data(8), batch_size=2); lazy_at = site()  # noqa: E702
seen["lazy"] = [lazy_at, *count(lazy, 2)]
pinned = Pinned(data(6), batch_size=3); pinned_at = site()  # noqa: E702
seen["pinned"] = [pinned_at, *count(pinned)]
multi = MultiEpochs(data(6), batch_size=2); multi_at = site()  # noqa: E702
seen["multi"] = [multi_at, *count(multi, 3)]
first = DataLoader(data(4), batch_size=2)
second = DataLoader(data(2), batch_size=2)
facade = Facade(first, second)
record(sys.argv[1], int(os.environ["RANK"]), seen=seen, facade=count(facade),
       pinned=pinned.pin_memory)
