"""A Lightning fit with CheckFreqCallback, for the exact-resume acceptance tests.

Resumes from ``--dir`` if a checkpoint is there, trains to the end (shuffled ResumableLoader,
random augmentation, dropout, BatchNorm, AdamW, an epoch-interval LR schedule) and writes the
final model, optimizer, scheduler and callback states to ``--out``. With ``--die-at K`` it
SIGKILLs itself right after optimizer step ``K`` (once the checkpoint in flight is durable).
Every batch's sample indices are appended to ``--log`` as ``epoch batch_idx index index ...``.

``--callbacks DIR`` adds Lightning's stateful callbacks beside CheckFreqCallback: a validation
loop, ``EarlyStopping`` on its loss (it stops after ``PATIENCE`` epochs without a large
improvement) and ``ModelCheckpoint(save_last=True)`` writing to ``DIR`` every 4 steps;
``--max-time`` is the Trainer's ``max_time``, ``--sleep-at K`` sleeps 2 s in optimizer step
``K`` (time the Timer counts) and ``--ckpt-path`` is passed to ``fit()``. ``--monitor-epoch DIR`` logs
``train_loss`` on step and epoch (``sync_dist=True``) and adds ``EarlyStopping`` and a top-1
``ModelCheckpoint`` writing to ``DIR``, both monitoring its epoch mean ``train_loss_epoch``. ``--plain``
leaves CheckFreqCallback out: the fit is Lightning's alone (``--ckpt-path`` resumes it Lightning's way).

With ``--devices 2`` the fit runs under ``--strategy`` (``ddp`` or ``ddp_spawn``) on two CPU
processes (gloo), each rank writing its final state (rank ``r > 0`` to ``--out`` + ``.r``); the
loader comes from ``train_dataloader()`` (built once the process group is up), ``--die-rank``
says which rank dies, and each rank logs to ``--log`` + ``.RANK``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from noisy_points import NoisyPoints  # beside this script
from torch import nn
from worker_exit import exit_without_teardown  # beside this script

from checkfreq.data import ResumableLoader
from checkfreq.integrations.lightning import CheckFreqCallback

SAMPLES, BATCH, EVERY = 72, 8, 3  # 9 optimizer steps per epoch
PATIENCE = 1


class Classifier(pl.LightningModule):
    def __init__(self, log_path: str, devices: int = 1) -> None:
        super().__init__()
        norm = nn.BatchNorm1d(32)
        self.net = nn.Sequential(nn.Linear(8, 32), norm, nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
        self.log_path = log_path if devices == 1 else None
        self.base_log = log_path
        self.sleep_at: int | None = None
        self.log_epoch = False

    def train_dataloader(self) -> ResumableLoader:
        """Built in the fit, once torch.distributed is up: the loader takes this rank's share."""
        self.log_path = f"{self.base_log}.{self.global_rank}"
        return ResumableLoader(NoisyPoints(SAMPLES), batch_size=BATCH // 2, shuffle=True, seed=5)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        with open(self.log_path, "a") as log:
            log.write(f"{self.current_epoch} {batch_idx} {' '.join(map(str, index.tolist()))}\n")
        if self.global_step + 1 == self.sleep_at:
            time.sleep(2)
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self.log_epoch:
            self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

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


class SaveFinal(pl.Callback):
    """Each rank prints where the fit started and ended and writes its final state (under ``ddp_spawn``
    the fit runs in processes of its own)."""

    def __init__(self, out: str, checkfreq: CheckFreqCallback) -> None:
        self.out, self.checkfreq = out, checkfreq

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank = trainer.global_rank
        print(f"rank {rank} restored {self.checkfreq.restored_step} final {trainer.global_step}", flush=True)
        watched = (EarlyStopping, ModelCheckpoint)
        callbacks = {cb.state_key: cb.state_dict() for cb in trainer.callbacks if isinstance(cb, watched)}
        metrics = {"callback": dict(trainer.callback_metrics), "logged": dict(trainer.logged_metrics)}
        torch.save(
            {
                "metrics": metrics,
                "model": pl_module.state_dict(),
                "optimizer": trainer.optimizers[0].state_dict(),
                "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                "callbacks": callbacks,
            },
            self.out if rank == 0 else f"{self.out}.{rank}",
        )  # each rank's BatchNorm buffers


def validation_points() -> torch.utils.data.DataLoader:
    """Fixed points, no augmentation: validating draws no random numbers."""
    points = NoisyPoints(SAMPLES // 2)
    data = torch.utils.data.TensorDataset(points.x, points.y, torch.arange(len(points)))
    return torch.utils.data.DataLoader(data, batch_size=BATCH)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--die-rank", type=int, default=0)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--callbacks", default=None)
    parser.add_argument("--max-time", default=None)
    parser.add_argument("--sleep-at", type=int, default=None)
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--monitor-epoch", default=None)
    parser.add_argument("--plain", action="store_true", help="Lightning alone, without CheckFreqCallback")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)

    model = Classifier(args.log, args.devices)
    model.sleep_at = args.sleep_at
    model.log_epoch = args.monitor_epoch is not None
    checkfreq = CheckFreqCallback(args.dir, policy=EVERY, keep=2)
    callbacks = [DieAt(args.die_at, checkfreq, args.die_rank), SaveFinal(args.out, checkfreq)]
    if not args.plain:
        callbacks.insert(0, checkfreq)
    if args.callbacks:
        callbacks += [
            EarlyStopping("val_loss", min_delta=10.0, patience=PATIENCE),
            ModelCheckpoint(args.callbacks, save_last=True, every_n_train_steps=4),
        ]
    if args.monitor_epoch:
        callbacks += [
            EarlyStopping("train_loss_epoch", min_delta=0.02, patience=PATIENCE),
            ModelCheckpoint(args.monitor_epoch, monitor="train_loss_epoch", filename="{epoch}-{step}"),
        ]
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        max_time=args.max_time,
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy if args.devices > 1 else "auto",
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(args.callbacks or args.monitor_epoch),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
        limit_val_batches=1.0 if args.callbacks else 0,
    )
    val = validation_points() if args.callbacks else None
    train = ResumableLoader(NoisyPoints(SAMPLES), batch_size=BATCH, shuffle=True, seed=5) if args.devices == 1 else None
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val, ckpt_path=args.ckpt_path)


if __name__ == "__main__":
    main()
    exit_without_teardown()
