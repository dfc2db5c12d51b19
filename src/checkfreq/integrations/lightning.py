"""Lightning: checkfreq's checkpointing as a ``Trainer`` callback.

``CheckFreqCallback`` registers the LightningModule, every optimizer and LR scheduler, the
precision plugin (its GradScaler) and the fit loop's progress with a
:class:`~checkfreq.Checkpointer`. It checkpoints from ``on_train_batch_end`` after each optimizer
step (as the policy decides) and restores in ``on_fit_start``, before the fit loop starts.

The fit loop's state includes the state of every train dataloader that has
``state_dict``/``load_state_dict``: with a :class:`checkfreq.data.ResumableLoader` as the train
dataloader, a resumed run continues mid-epoch at the next unseen batch, and ends bit-identical
to an uninterrupted one. See docs/lightning.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch

from checkfreq.checkpointer import CHECKPOINTER_OPTIONS, Checkpointer
from checkfreq.data import ResumableLoader
from checkfreq.errors import UsageError
from checkfreq.integrations.loss import LossFeed
from checkfreq.options import check_names
from checkfreq.policies import Policy
from checkfreq.retention import Retention
from checkfreq.storage import Store

log = logging.getLogger("checkfreq.integrations.lightning")


class FitLoopState:
    """The trainer's fit-loop progress (epochs, batches, optimizer steps, dataloader states) as a stateful object."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self._trainer = trainer

    @property
    def epoch(self) -> int:
        """The current epoch, which lets epoch-based policies see epoch boundaries."""
        return self._trainer.current_epoch

    def state_dict(self) -> dict[str, Any]:
        return self._trainer.fit_loop.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._trainer.fit_loop.load_state_dict(state)


class CheckFreqCallback(pl.Callback):
    """Checkpoint a Lightning fit with checkfreq: frequent, cheap, exact to resume.

    Args:
        directory: where checkpoints go: a path, an fsspec URL or a :class:`~checkfreq.storage.Store`.
        policy: when to checkpoint (see :class:`~checkfreq.Checkpointer`); counted in optimizer steps.
        keep: committed checkpoints to keep.
        remote: optional second tier, copied to in the background (see docs/storage.md).
        remote_keep: checkpoints to keep in ``remote`` (default: ``keep``).
        resume: restore the newest valid checkpoint when the fit starts.
        save_on_train_end: take a blocking checkpoint when training ends.
        monitor: what convergence-aware policies see as the loss: ``None`` for the loss
            ``training_step`` returns, or the name of a metric logged with ``self.log``. It is read
            without a device sync (see :class:`~checkfreq.integrations.loss.LossFeed`).
        **options: further :class:`~checkfreq.Checkpointer` options (``on_error``,
            ``persist_timeout``, ``save_on_signal``, ``values``, ...); any other keyword raises
            ``TypeError`` naming the closest option.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | Store,
        *,
        policy: Policy | str | int = "auto",
        keep: int | Retention = 3,
        remote: str | os.PathLike[str] | Store | None = None,
        remote_keep: int | Retention | None = None,
        resume: bool = True,
        save_on_train_end: bool = True,
        monitor: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        check_names("CheckFreqCallback", options, _OPTIONS)  # the explicit ones never reach **options
        self._settings = dict(policy=policy, keep=keep, remote=remote, remote_keep=remote_keep, **options)
        self._directory = directory
        self._resume = resume
        self._save_on_train_end = save_on_train_end
        self._monitor = monitor
        self._loss = LossFeed()
        self._checkpointer: Checkpointer | None = None
        self._seen_step = 0
        self.restored_step = 0
        """The optimizer step restored at the start of the fit (0 for a fresh run)."""

    @property
    def checkpointer(self) -> Checkpointer:
        """The :class:`~checkfreq.Checkpointer` of the running fit."""
        if self._checkpointer is None:
            raise UsageError("CheckFreqCallback has no checkpointer outside Trainer.fit()")
        return self._checkpointer

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._checkpointer = Checkpointer(self._directory, **self._settings, **_objects(trainer, pl_module))
        if self._resume:
            self.restored_step = self._checkpointer.restore()
            if self.restored_step:
                log.info("resuming at epoch %d, optimizer step %d", trainer.current_epoch, trainer.global_step)
        self._seen_step = trainer.global_step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _check_global_batches(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._loss.push(_loss_of(outputs, trainer) if self._monitor is None else trainer.callback_metrics.get(self._monitor))
        if trainer.global_step == self._seen_step:
            return  # accumulating gradients: no optimizer step, nothing consistent to save
        self._seen_step = trainer.global_step
        self.checkpointer.step(loss=self._loss.take())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._save_on_train_end:
            self.checkpointer.save(blocking=True)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        checkpointer, self._checkpointer = self._checkpointer, None
        if checkpointer is not None:
            checkpointer.close()


_OPTIONS = (*CHECKPOINTER_OPTIONS, "resume", "save_on_train_end", "monitor")


def _check_global_batches(trainer: pl.Trainer) -> None:
    """Refuse a fit whose optimizer steps would not take the train loader's global batches.

    Lightning steps the optimizer every ``accumulate_grad_batches`` batches, counted from the start
    of the epoch, also after a restore. So that counter must match the loader's split at this world
    size, and a position restored mid-epoch must be a whole number of steps in it.
    """
    loaders = trainer.train_dataloader
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
        if not isinstance(loader, ResumableLoader) or loader.sampler.global_batch_size is None:
            continue
        steps = loader.accumulation_steps
        if trainer.accumulate_grad_batches != steps:
            raise UsageError(
                f"the train loader hands each of the {loader.sampler.world_size} rank(s) {steps} batch(es) of "
                f"{loader.batch_size} samples per optimizer step (global_batch_size={loader.global_batch_size}), but "
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}): pass accumulate_grad_batches={steps}"
            )
        done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        taken = loader.sampler.consumed // loader.global_batch_size
        if len(loader.sampler) and done != taken * steps:
            raise UsageError(
                f"the restored fit counts {done} batches into epoch {loader.epoch}, which is not {taken} optimizer "
                f"steps of {steps} batches at this world size: the checkpoint was taken with another number of "
                "batches per step, and Lightning would step in the middle of global batches. Resume at the saved "
                "world size, or with a micro_batch_size that gives as many batches per step, until the epoch ends."
            )


def _loss_of(outputs: Any, trainer: pl.Trainer) -> Any:
    """The loss ``training_step`` returned; Lightning hands callbacks it divided by the accumulation factor."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    return loss * trainer.accumulate_grad_batches if isinstance(loss, torch.Tensor) else loss


def _objects(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """What a Lightning fit consists of, by name, for the Checkpointer."""
    objects: dict[str, Any] = {"model": pl_module, "fit_loop": FitLoopState(trainer), "precision": trainer.precision_plugin}
    for i, optimizer in enumerate(trainer.optimizers):
        objects[f"optimizer{i}"] = optimizer
    for i, config in enumerate(trainer.lr_scheduler_configs):
        objects[f"scheduler{i}"] = config.scheduler
    return objects
