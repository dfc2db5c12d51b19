"""A Lightning fit that keeps the best checkpoints by a noisy validation loss, killable at a step.

``python lightning_best.py DIR OUT KILL_STEP [VAL_EVERY [RESUME]]``: 5 epochs of 6 optimizer steps over a
:class:`ResumableLoader`, with ``CheckFreqCallback(DIR, policy=4, keep=2, monitor="val_loss",
mode="min", save_top_k=2)``. The validation runs after each epoch (or every ``VAL_EVERY`` batches
with ``val_check_interval``); its ``val_loss`` is the model's loss plus a noise of the step
(:data:`NOISE`), so that the best are not the newest. Each validation appends ``{"step", "val_loss"}``
to ``OUT.evals`` and writes the weights to ``OUT.models/STEP.pt``; at ``KILL_STEP`` (0: never) the
process SIGKILLs itself right after that optimizer step; at the end the weights go to ``OUT`` and the
step the fit restored to ``OUT.restored``. ``VAL_EVERY`` 0: after each epoch; ``RESUME`` ``best``: the
callback's ``resume="best"``.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import lightning.pytorch as pl
import torch
from torch import nn
from worker_exit import exit_without_teardown  # beside this script

from checkfreq.data import ResumableLoader
from checkfreq.integrations.lightning import CheckFreqCallback

EPOCHS, BATCHES, BATCH = 5, 6, 4
NOISE = {6: 0.0, 12: 2.0, 18: -0.5, 24: 1.5, 30: 1.0, 3: 0.0, 9: 1.0, 15: -0.8, 21: 2.0, 27: 1.0}
"""Added to the validation loss at a step: the best two are neither the newest nor the same as the least loss's."""


class Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return BATCHES * BATCH

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, generator=g), torch.tensor(i % 3)


class Classifier(pl.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
        self.out = out

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> None:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y) + NOISE.get(self.global_step, 3.0)
        self.log("val_loss", loss)

    def on_validation_end(self) -> None:
        value = float(self.trainer.callback_metrics["val_loss"])
        with open(f"{self.out}.evals", "a") as f:
            f.write(json.dumps({"step": self.global_step, "val_loss": value}) + "\n")
        torch.save(self.state_dict(), f"{self.out}.models/{self.global_step}.pt")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class DieAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(directory: str, out: str, kill_step: int, val_every: int | None, resume: bool | str) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    os.makedirs(f"{out}.models", exist_ok=True)
    model = Classifier(out)
    checkfreq = CheckFreqCallback(
        directory, policy=4, keep=2, monitor="val_loss", mode="min", save_top_k=2, resume=resume
    )
    val = torch.utils.data.DataLoader(Points(), batch_size=8)
    trainer = pl.Trainer(
        max_epochs=EPOCHS,
        accelerator="cpu",
        callbacks=[checkfreq, DieAt(kill_step)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
        val_check_interval=val_every,
    )
    train = ResumableLoader(Points(), batch_size=BATCH, shuffle=True, seed=5)
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val)
    torch.save(model.state_dict(), out)
    with open(f"{out}.restored", "w") as f:
        f.write(str(checkfreq.restored_step))


if __name__ == "__main__":
    every = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), every or None, sys.argv[5] if len(sys.argv) > 5 else True)
    exit_without_teardown()
