"""A 2-epoch Lightning fit with CheckFreqCallback, for the exact-resume acceptance tests.

Resumes from ``--dir`` if a checkpoint is there, trains to the end (shuffled ResumableLoader,
random augmentation, dropout, BatchNorm, AdamW, an epoch-interval LR schedule) and writes the
final model and optimizer state to ``--out``. With ``--die-at K`` it SIGKILLs itself right after
optimizer step ``K`` (once the checkpoint in flight is durable). Every batch's sample indices are
appended to ``--log`` as ``epoch batch_idx index index ...``.

With ``--devices 2`` the fit runs under ``strategy="ddp"`` on two CPU processes (gloo), each rank
writing its final state (rank ``r > 0`` to ``--out`` + ``.r``); the loader comes from ``train_dataloader()`` (built once the process group is up),
``--die-rank`` says which rank dies, and each rank logs to ``--log`` + ``.RANK``.
"""

from __future__ import annotations

import argparse
import os
import signal

import lightning.pytorch as pl
import torch
from torch import nn

from checkfreq.data import ResumableLoader
from checkfreq.integrations.lightning import CheckFreqCallback
from noisy_points import NoisyPoints  # beside this script

SAMPLES, BATCH, EPOCHS, EVERY = 72, 8, 2, 3  # 9 optimizer steps per epoch


class Classifier(pl.LightningModule):
    def __init__(self, log_path: str, devices: int = 1) -> None:
        super().__init__()
        norm = nn.BatchNorm1d(32)
        self.net = nn.Sequential(nn.Linear(8, 32), norm, nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
        self.log_path = log_path if devices == 1 else None
        self.base_log = log_path

    def train_dataloader(self) -> ResumableLoader:
        """Built in the fit, once torch.distributed is up: the loader takes this rank's share."""
        self.log_path = f"{self.base_log}.{self.global_rank}"
        return ResumableLoader(NoisyPoints(SAMPLES), batch_size=BATCH // 2, shuffle=True, seed=5)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        with open(self.log_path, "a") as log:
            log.write(f"{self.current_epoch} {batch_idx} {' '.join(map(str, index.tolist()))}\n")
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}


class DieAt(pl.Callback):
    """SIGKILL this process right after optimizer step ``step``, as a node failure would."""

    def __init__(self, step: int | None, checkfreq: CheckFreqCallback, rank: int = 0) -> None:
        self.step, self.checkfreq, self.rank = step, checkfreq, rank

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            self.checkfreq.checkpointer.wait()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--die-rank", type=int, default=0)
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)

    model = Classifier(args.log, args.devices)
    checkfreq = CheckFreqCallback(args.dir, policy=EVERY, keep=2)
    trainer = pl.Trainer(
        max_epochs=EPOCHS, accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto",
        callbacks=[checkfreq, DieAt(args.die_at, checkfreq, args.die_rank)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, deterministic=True,
    )
    if args.devices == 1:
        trainer.fit(model, train_dataloaders=ResumableLoader(NoisyPoints(SAMPLES), batch_size=BATCH, shuffle=True, seed=5))
    else:
        trainer.fit(model)
    print(f"rank {trainer.global_rank} restored {checkfreq.restored_step} final {trainer.global_step}", flush=True)
    out = args.out if trainer.global_rank == 0 else f"{args.out}.{trainer.global_rank}"  # each rank's BatchNorm buffers
    torch.save({"model": model.state_dict(), "optimizer": trainer.optimizers[0].state_dict(),
                "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict()}, out)


if __name__ == "__main__":
    main()
