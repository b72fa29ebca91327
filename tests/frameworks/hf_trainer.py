"""The Hugging Face Trainer with a tiny module defined here; nothing downloaded."""

import sys

import torch
from common import Points, record, workers_seen
from transformers import Trainer, TrainerCallback, TrainingArguments


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.lin(x).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Dicts(Points):
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        x, y = super().__getitem__(i)
        return {"x": x, "labels": y}


class Count(TrainerCallback):
    def __init__(self) -> None:
        self.per_epoch: list[int] = []
        self.seen: list[dict[str, float | None]] = []
        self.steps = 0

    def on_epoch_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        self.per_epoch.append(0)

    def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        self.per_epoch[-1] += 1
        self.steps += 1
        if self.per_epoch[-1] == 6:
            self.seen.append(workers_seen(self.steps, "train"))


def main(out: str) -> None:
    args = TrainingArguments(output_dir=out + "/hf", per_device_train_batch_size=8,
                             num_train_epochs=2, report_to="none", dataloader_num_workers=1,
                             save_strategy="no", logging_strategy="no", use_cpu=True,
                             disable_tqdm=True, remove_unused_columns=False,
                             eval_strategy="epoch", per_device_eval_batch_size=8)
    count = Count()
    trainer = Trainer(model=Tiny(), args=args, train_dataset=Dicts(96), eval_dataset=Dicts(32),
                      callbacks=[count])
    trainer.train()
    record(out, 0, steps=trainer.state.global_step, counted=count.steps,
           per_epoch=count.per_epoch, seen=count.seen, eval_batches=2 * 4)


if __name__ == "__main__":
    main(sys.argv[1])
