"""torchdata's StatefulDataLoader and webdataset's WebLoader under zero-code mode, with no
exporter code. argv: OUT SHARDS... (tar shards of 14 samples each, written by the test).

The StatefulDataLoader runs a full epoch, 5 batches, state_dict(), then a fresh loader
built at the same line resumes from that state (as a restarted job does); the WebLoader
makes batches of 4 in 2 workers and rebatches them into 5s. Each records what the loop
took, for the test to compare with the snapshot.
"""

import sys

import torch
import webdataset as wds
from common import record, site
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader


class Squares(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i * i)])


def stateful() -> StatefulDataLoader:
    return StatefulDataLoader(Squares(), batch_size=3, shuffle=True, num_workers=2,
                              generator=torch.Generator().manual_seed(1))


batches = samples = 0
state = None
settings = []
for round_ in range(2):
    loader = stateful(); stateful_at = site()  # noqa: E702
    settings.append(loader.prefetch_factor)
    if state is not None:
        loader.load_state_dict(state)
    for i, b in enumerate(loader):
        batches, samples = batches + 1, samples + len(b)
        if round_ == 1:
            continue
        if i == 6:  # the whole first epoch (7 batches), then 5 of the next
            it = iter(loader)
            for _ in range(5):
                b = next(it)
                batches, samples = batches + 1, samples + len(b)
            state = loader.state_dict()
            break

shards = wds.WebDataset(sys.argv[2:], shardshuffle=False).decode()
shards = shards.to_tuple("__key__", "txt", "cls").batched(4)
web = wds.WebLoader(shards, batch_size=None, num_workers=2); web_at = site()  # noqa: E702
web = web.unbatched().batched(5)
web_batches = web_samples = 0
for keys, _, _ in web:
    web_batches, web_samples = web_batches + 1, web_samples + len(keys)

helper = f"data_libraries.py:{stateful.__code__.co_firstlineno + 1}-{stateful_at}"
record(sys.argv[1], 0, stateful={"name": helper, "batches": batches, "samples": samples,
                                 "prefetch_factor": settings},
       web={"name": web_at, "batches": web_batches, "samples": web_samples})
