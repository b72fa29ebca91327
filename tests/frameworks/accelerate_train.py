"""Accelerate under torchrun, no exporter code: the loader is prepared (rebuilt) by Accelerate."""

import sys

import torch
from accelerate import Accelerator
from common import Points, record, site, workers_seen
from torch.utils.data import DataLoader

EPOCHS = 2


def main(out: str) -> None:
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Points(256), batch_size=8, num_workers=1, shuffle=True); name = site()  # noqa: E702
    model, opt, loader = acc.prepare(model, opt, loader)
    steps, per_epoch, seen = 0, [], []
    for _ in range(EPOCHS):
        n = 0
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            n += 1
            steps += 1
            if n == 8:  # mid-epoch, batches flowing: what do the metrics say?
                seen.append(workers_seen(steps, name))
        per_epoch.append(n)
    record(out, acc.process_index, steps=steps, per_epoch=per_epoch, seen=seen)
    acc.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
