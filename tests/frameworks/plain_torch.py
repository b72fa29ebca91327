"""Plain torch, run with the environment switch alone. argv: OUT.

Loaders of every kind in one process: one built by a method named like a framework's
(train_dataloader), a plain script's train and validation loaders over one dataset class
(named by the line that built each), two more built by one helper called from two lines,
an explicit instrument.DataLoader, a wrap()ped one, and one instrument.DataLoader never
iterated.
"""

import sys

import torch
from common import record, site
from torch.utils.data import DataLoader, Dataset, TensorDataset

from dataloader_exporter import instrument


class Squares(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i * i)])


def train_dataloader() -> DataLoader:  # type: ignore[type-arg]
    return DataLoader(Squares(), batch_size=4, num_workers=1)


def count(loader: object, epochs: int = 1) -> int:
    return sum(1 for _ in range(epochs) for _ in loader)  # type: ignore[attr-defined]


train = train_dataloader()
batches = {"train": count(train, 2)}
iter(train)  # a framework's probe: no batch fetched, so no epoch
def helper_loader(n: int) -> DataLoader:  # type: ignore[type-arg]
    return DataLoader(TensorDataset(torch.arange(float(n))), batch_size=2)


plain = DataLoader(TensorDataset(torch.arange(6.0)), batch_size=3); plain_at = site()  # noqa: E702
val = DataLoader(TensorDataset(torch.arange(4.0)), batch_size=1); val_at = site()  # noqa: E702
batches[plain_at] = count(plain)
batches[val_at] = count(val)
first, first_at = helper_loader(4), site()
second, second_at = helper_loader(6), site()
helper_at = f"plain_torch.py:{helper_loader.__code__.co_firstlineno + 1}"
batches[f"{helper_at}-{first_at}"] = count(first)
batches[f"{helper_at}-{second_at}"] = count(second)
mine = instrument.DataLoader(Squares(), batch_size=6, name="mine")
batches["mine"] = count(mine)
wrapped = instrument.wrap(DataLoader(Squares(), batch_size=2), name="wrapped")
batches["wrapped"] = count(wrapped)
lonely = instrument.DataLoader(Squares(), batch_size=6, name="lonely")
record(sys.argv[1], 0, batches=batches, wrapped_is_a_dataloader=isinstance(wrapped, DataLoader),
       train={"num_workers": train.num_workers, "prefetch_factor": train.prefetch_factor,
              "persistent_workers": train.persistent_workers},
       plain_workers=plain.num_workers, plain_at=plain_at, val_at=val_at)
