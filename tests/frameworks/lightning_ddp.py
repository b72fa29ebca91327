"""Lightning, strategy="ddp" on CPU, 2 processes. argv: OUT MODE (plain or wrap)."""

import os
import sys

import lightning as L
import torch
from common import Points, record
from torch.utils.data import DataLoader

OUT, MODE = sys.argv[1], sys.argv[2]


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.per_epoch: list[int] = []

    def on_train_epoch_start(self) -> None:
        self.per_epoch.append(0)

    def training_step(self, batch, i):  # type: ignore[no-untyped-def]
        self.per_epoch[-1] += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:  # type: ignore[type-arg]
        loader = DataLoader(Points(512), batch_size=16, num_workers=1)
        if MODE == "wrap":
            from dataloader_exporter import instrument

            return instrument.wrap(loader, name="train")  # type: ignore[no-any-return]
        return loader


if __name__ == "__main__":
    model = Model()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=2,
                        enable_checkpointing=False, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model)
    record(OUT, trainer.global_rank, steps=sum(model.per_epoch), per_epoch=model.per_epoch,
           loader_type=type(trainer.train_dataloader).__name__,
           sampler=type(getattr(trainer.train_dataloader, "sampler", None)).__name__,
           rank_env=os.environ.get("RANK"))
