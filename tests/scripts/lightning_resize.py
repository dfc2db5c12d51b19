"""A Lightning fit over a ResumableLoader with a global batch, for the resize tests (tests/distributed/test_elastic.py).

The model and its training step are ``lightning_train.py``'s; the loader has ``global_batch_size=8``
(``--micro``: each rank's batches at most that many samples) and the Trainer
``accumulate_grad_batches=--accumulate``. Resumes from ``--dir`` if a checkpoint is there. Each rank
appends ``step rank index index ...`` per batch to ``--log`` (``step``: the optimizer step the batch
belongs to). ``--die-at K``: rank 0 SIGKILLs itself after optimizer step K, once the checkpoint in
flight is durable (checkpoints every 3 steps).
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from lightning_train import SAMPLES, Classifier, DieAt  # beside this script
from noisy_points import NoisyPoints
from worker_exit import exit_without_teardown  # beside this script

from checkfreq.data import ResumableLoader
from checkfreq.integrations.lightning import CheckFreqCallback

GLOBAL_BATCH, EPOCHS = 8, 2  # 9 optimizer steps per epoch


class GlobalBatchClassifier(Classifier):
    def __init__(self, log_path: str, micro: int | None) -> None:
        super().__init__(log_path)
        self.micro = micro

    def train_dataloader(self) -> ResumableLoader:
        return ResumableLoader(
            NoisyPoints(SAMPLES), global_batch_size=GLOBAL_BATCH, micro_batch_size=self.micro, shuffle=True, seed=5
        )

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        with open(self.base_log, "a") as log:
            log.write(f"{self.trainer.global_step + 1} {self.global_rank} {' '.join(map(str, index.tolist()))}\n")
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_epoch=True, sync_dist=True)  # each rank's epoch sums: not for another size
        return loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--micro", type=int, default=None)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--die-at", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    checkfreq = CheckFreqCallback(args.dir, policy=3, keep=2)
    trainer = pl.Trainer(
        max_epochs=EPOCHS,
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        accumulate_grad_batches=args.accumulate,
        callbacks=[checkfreq, DieAt(args.die_at, checkfreq)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
    )
    trainer.fit(GlobalBatchClassifier(args.log, args.micro))
    print(f"rank {trainer.global_rank} restored {checkfreq.restored_step} final {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
    exit_without_teardown()
