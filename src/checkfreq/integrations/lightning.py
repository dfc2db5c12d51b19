"""Lightning: checkfreq's checkpointing as a ``Trainer`` callback.

``CheckFreqCallback`` registers the LightningModule, every optimizer and LR scheduler, the
precision plugin (its GradScaler), the DataModule, the fit loop's progress and the state of the
Trainer's other callbacks (``EarlyStopping``, ``ModelCheckpoint``, the ``Timer`` behind
``max_time``) with a :class:`~checkfreq.Checkpointer`. It hands each optimizer step to the policy
from ``on_train_batch_end``, after every other callback's (an epoch's last step once the epoch,
its validation included, has ended), and restores in ``on_fit_start``, before the fit loop
starts. A ``Trainer.fit(ckpt_path=...)`` beside it resumes Lightning's way when checkfreq's directory
holds no checkpoint (checkfreq checkpoints the fit from that step on), and is refused otherwise: two
checkpoints would be mixed. The logged metrics' epoch aggregates are checkpointed too (see
:mod:`checkfreq.integrations.lightning_metrics`).

The fit loop's state includes the state of every train dataloader that has
``state_dict``/``load_state_dict``: with a :class:`checkfreq.data.ResumableLoader` as the train
dataloader, a resumed run continues mid-epoch at the next unseen batch, and ends bit-identical
to an uninterrupted one. See docs/lightning.md.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint, Timer

from checkfreq.checkpointer import CHECKPOINTER_OPTIONS, Checkpointer
from checkfreq.data import ResumableLoader
from checkfreq.errors import ExistingCheckpointsError, InvalidArgumentError, UsageError
from checkfreq.integrations.best import best_retention
from checkfreq.integrations.lightning_metrics import EpochMetrics
from checkfreq.integrations.loss import LossFeed
from checkfreq.policies import Policy
from checkfreq.policies.retention import Retention
from checkfreq.run.options import check_names
from checkfreq.storage import Store

log = logging.getLogger("checkfreq.integrations.lightning")

_METRICS = "checkfreq.logged_metrics"  # beside the fit loop's own keys


class FitLoopState:
    """The trainer's fit-loop progress (epochs, batches, optimizer steps, dataloader states) and its
    logged metrics (the running epoch's aggregates included, see :class:`EpochMetrics`) as a stateful object."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self._trainer = trainer
        self._metrics = EpochMetrics(trainer)

    @property
    def epoch(self) -> int:
        """The current epoch, which lets epoch-based policies see epoch boundaries."""
        return self._trainer.current_epoch

    def state_dict(self) -> dict[str, Any]:
        return {**self._trainer.fit_loop.state_dict(), _METRICS: self._metrics.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        metrics = state.pop(_METRICS, None)
        self._trainer.fit_loop.load_state_dict(state)
        if metrics is None:
            log.warning(
                "the checkpoint, from an earlier checkfreq version, holds no logged metrics: the epoch values "
                "of a fit resumed mid-epoch cover only the batches trained after the resume"
            )
        else:
            self._metrics.load_state_dict(metrics)


class CallbackStates:
    """The ``state_dict()`` of the Trainer's callbacks other than ``owner``, keyed by
    ``Callback.state_key`` as in Lightning's own checkpoints (callbacks without state are left out),
    and the wall-clock time they were taken at."""

    def __init__(self, trainer: pl.Trainer, owner: pl.Callback) -> None:
        self._trainer = trainer
        self._owner = owner
        self.saved_at: float | None = None
        """When the restored states were taken (``time.time()``); None until a restore."""

    def _callbacks(self) -> dict[str, pl.Callback]:
        return {cb.state_key: cb for cb in self._trainer.callbacks if cb is not self._owner}

    def state_dict(self) -> dict[str, Any]:
        states = {key: state for key, callback in self._callbacks().items() if (state := callback.state_dict())}
        return {"saved_at": time.time(), "states": states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        callbacks, saved = self._callbacks(), state["states"]
        stateful = {key for key, callback in callbacks.items() if callback.state_dict()}
        if gone := sorted(saved.keys() - callbacks.keys()):
            log.warning(
                "the checkpoint holds the state of callbacks this Trainer lacks, which is dropped: %s", ", ".join(gone)
            )
        if new := sorted(stateful - saved.keys()):
            log.warning("callbacks with state that the checkpoint does not hold start afresh: %s", ", ".join(new))
        for key, callback_state in saved.items():
            if key in callbacks:
                callbacks[key].load_state_dict(callback_state)
                if isinstance(callbacks[key], ModelCheckpoint) and "current_score" in callback_state:
                    callbacks[key].current_score = callback_state["current_score"]  # its load_state_dict skips it
        self.saved_at = state["saved_at"]


class CheckFreqCallback(pl.Callback):
    """Checkpoint a Lightning fit with checkfreq: frequent, cheap, exact to resume.

    Args:
        directory: where checkpoints go: a path, an fsspec URL or a :class:`~checkfreq.storage.Store`.
        policy: when to checkpoint (see :class:`~checkfreq.Checkpointer`); counted in optimizer steps.
        keep: committed checkpoints to keep.
        remote: optional second tier, copied to in the background (see docs/storage.md).
        remote_keep: checkpoints to keep in ``remote`` (default: ``keep``).
        resume: restore the newest valid checkpoint when the fit starts; ``"best"``: the best by
            ``monitor`` (with ``save_top_k``), to go on from it: the newer checkpoints are then of a
            course the fit left and are set aside (docs/lightning.md, "Going back to the best");
            ``False``: start afresh (an empty directory only).
        save_on_train_end: take a blocking checkpoint when training ends.
        monitor: what convergence-aware policies see as the loss: ``None`` for the loss
            ``training_step`` returns, or the name of a metric logged with ``self.log``. It is read
            without a device sync (see :class:`~checkfreq.integrations.loss.LossFeed`). With
            ``save_top_k``, also the metric the best checkpoints are kept by, as ``ModelCheckpoint``'s.
        mode: ``"min"`` or ``"max"``: whether a lower or a higher ``monitor`` is better (with ``save_top_k``).
        save_top_k: keep the ``save_top_k`` checkpoints with the best ``monitor`` after a validation,
            beside the newest ``keep`` (``keep=Retention(keep, best=(monitor, mode), top=save_top_k)``;
            -1 keeps every validated checkpoint, 0 or None none for its score). See docs/lightning.md.
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
        resume: bool | Literal["best"] = True,
        save_on_train_end: bool = True,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        check_names("CheckFreqCallback", options, _OPTIONS)  # the explicit ones never reach **options
        keep = best_retention(keep, monitor, mode, save_top_k, names=("monitor", "mode", "save_top_k"))
        self._best = keep.metric if isinstance(keep, Retention) else None
        self._validated: Any = None  # the epoch's validation value, logged once its last step is counted
        self._settings = dict(policy=policy, keep=keep, remote=remote, remote_keep=remote_keep, **options)
        self._directory = directory
        if not isinstance(resume, bool) and resume != "best":
            raise InvalidArgumentError(f"resume takes True, False or 'best', got {resume!r}")
        if resume == "best" and self._best is None:
            raise InvalidArgumentError(
                "resume='best' goes back to the best checkpoint by monitor: it needs monitor= and save_top_k= too"
            )
        self._resume = resume
        self._save_on_train_end = save_on_train_end
        self._monitor = monitor
        self._loss = LossFeed()
        self._checkpointer: Checkpointer | None = None
        self._seen_step = 0
        self._epoch_ending = False
        self.restored_step = 0
        """The optimizer step restored at the start of the fit (0 for a fresh run)."""

    @property
    def checkpointer(self) -> Checkpointer:
        """The :class:`~checkfreq.Checkpointer` of the running fit."""
        if self._checkpointer is None:
            raise UsageError("CheckFreqCallback has no checkpointer outside Trainer.fit()")
        return self._checkpointer

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Run last among the callbacks, so that a checkpoint holds each of them as of the end of its step."""
        _place(trainer, self, first=False)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_ending, self._validated = False, None
        callbacks = CallbackStates(trainer, self)
        self._checkpointer = Checkpointer(self._directory, **self._settings, **_objects(trainer, pl_module, callbacks))
        if trainer.ckpt_path is not None:
            _hand_over_from_ckpt_path(trainer, self._checkpointer)
        elif self._resume:
            self.restored_step = self._checkpointer.restore(step="best" if self._resume == "best" else None)
            if self.restored_step:
                log.info("resuming at epoch %d, optimizer step %d", trainer.current_epoch, trainer.global_step)
                for timer in (cb for cb in trainer.callbacks if isinstance(cb, Timer)):
                    timer.on_fit_start(trainer, pl_module)  # its check ran before the restore: run it again
                if trainer.is_global_zero and callbacks.saved_at is not None:
                    _remove_lost_model_checkpoints(trainer, callbacks.saved_at)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seen_step = trainer.global_step  # once Lightning restored a ckpt_path's loops too
        _check_global_batches(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._loss.push(
            _loss_of(outputs, trainer) if self._monitor is None else trainer.callback_metrics.get(self._monitor)
        )
        if trainer.global_step == self._seen_step:
            return  # accumulating gradients: no optimizer step, nothing consistent to save
        self._seen_step = trainer.global_step
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self._epoch_ending = True  # validation and the epoch-end hooks still belong to this step
            _place(trainer, self, first=True)  # the next epoch's start is checkpointed before the others see it
            return
        self.checkpointer.step(loss=self._loss.take())
        self.checkpointer.consistent_point()  # Lightning's step ends here (its validation logs after it)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._epoch_ending:
            _start_epoch_progress(trainer)
        self._step_after_epoch_end(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step_after_epoch_end(trainer)
        if self._save_on_train_end:
            self.checkpointer.save(blocking=True)

    def _step_after_epoch_end(self, trainer: pl.Trainer) -> None:
        """Count the epoch's last optimizer step once the epoch has ended: a checkpoint taken then holds
        what its validation, ``EarlyStopping``, ``ModelCheckpoint`` and epoch-interval schedulers did,
        which Lightning does not run again when it resumes from a checkpoint taken at the batch's end.
        It comes before the other callbacks' ``on_train_epoch_start``, which Lightning calls again on
        resuming from it; then the callback goes back to the end of the list."""
        if self._epoch_ending:
            self._epoch_ending = False
            self.checkpointer.step(loss=self._loss.take())
            if self._validated is not None:
                self.checkpointer.log(**{str(self._best): self._validated})
                self._validated = None
            self.checkpointer.consistent_point()  # the epoch's work is done
            _place(trainer, self, first=False)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """With ``save_top_k``: the validation's ``monitor`` scores the checkpoint of its step (an epoch's
        last step is counted after the epoch, its validation included, has ended: the value waits for it)."""
        value = None if self._best is None or trainer.sanity_checking else trainer.callback_metrics.get(self._best)
        if value is None:
            return
        if self._epoch_ending:
            self._validated = value
        else:
            self.checkpointer.log(**{self._best: value})

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        checkpointer, self._checkpointer = self._checkpointer, None
        if checkpointer is not None:
            checkpointer.close()


_OPTIONS = (*CHECKPOINTER_OPTIONS, "resume", "save_on_train_end", "monitor", "mode", "save_top_k")


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
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}): "
                f"pass accumulate_grad_batches={steps}"
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


def _place(trainer: pl.Trainer, callback: pl.Callback, *, first: bool) -> None:
    """Put ``callback`` first or last in ``trainer.callbacks``: a new list, as Lightning may be
    iterating over the current one (to call ``setup``, ``on_train_batch_end``, ...)."""
    others = [cb for cb in trainer.callbacks if cb is not callback]
    trainer.callbacks = [callback, *others] if first else [*others, callback]


def _start_epoch_progress(trainer: pl.Trainer) -> None:
    """Zero the epoch loop's counters of the epoch that ended, as Lightning does right after
    ``on_train_epoch_start``: a checkpoint taken in that hook then resumes as at the new epoch's start
    (with the old epoch's counts Lightning would take the new epoch for one already trained)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    epoch_loop.batch_progress.reset_on_run()
    epoch_loop.scheduler_progress.reset_on_run()
    epoch_loop.automatic_optimization.optim_progress.reset_on_run()
    epoch_loop.val_loop.batch_progress.total.reset()


def _hand_over_from_ckpt_path(trainer: pl.Trainer, checkpointer: Checkpointer) -> None:
    """Let Lightning resume the fit from ``fit(ckpt_path=...)``, its own way, and checkpoint it from that
    step on; refused when checkfreq's directory holds checkpoints: Lightning restores the file partly
    before ``on_fit_start`` and partly after it, so beside a checkfreq restore the fit would go on from
    a mix of two checkpoints."""
    path = str(trainer.ckpt_path)
    step = trainer._checkpoint_connector._loaded_checkpoint.get("global_step")
    if step is None:  # strategies that restore after setup (FSDP, DeepSpeed), which the callback does not cover
        strategy = type(trainer.strategy).__name__
        raise UsageError(
            f"Trainer.fit(ckpt_path={path!r}) beside CheckFreqCallback: under {strategy} Lightning "
            "loads the file after the fit starts; leave ckpt_path out"
        )
    try:
        checkpointer.start_at(int(step))
    except ExistingCheckpointsError as e:
        raise UsageError(
            f"Trainer.fit(ckpt_path={path!r}) beside CheckFreqCallback, whose directory holds checkpoints: Lightning "
            "would restore the optimizers, schedulers and loop progress of that file over the state checkfreq "
            "restores, a mix of two checkpoints. Leave ckpt_path out to resume from checkfreq's newest checkpoint "
            f"(ModelCheckpoint may go on writing its files beside it), or give the callback a directory of its own to "
            f"go on from the file. ({e})"
        ) from e
    log.info(
        "Lightning resumes the fit from %s (optimizer step %d) as its own resume does; checkfreq checkpoints "
        "it from there on",
        path,
        int(step),
    )


def _remove_lost_model_checkpoints(trainer: pl.Trainer, saved_at: float) -> None:
    """Remove the files each ``ModelCheckpoint`` wrote after the restored checkpoint was taken: the
    run that wrote them died, the resumed fit writes them again at the same steps, and over them
    rather than beside them (``last-v1.ckpt``, ``epoch=0-step=4-v1.ckpt``). Files the restored
    state knows of, and any written before, are kept."""
    for callback in trainer.callbacks:
        if not isinstance(callback, ModelCheckpoint) or not callback.dirpath:
            continue
        fs = get_filesystem(callback.dirpath)
        if not fs.isdir(callback.dirpath):
            continue
        known = {
            callback.last_model_path,
            callback.best_model_path,
            callback.kth_best_model_path,
            *callback.best_k_models,
        }
        for entry in fs.ls(callback.dirpath, detail=True):
            path = entry["name"]
            if path.endswith(callback.FILE_EXTENSION) and path not in known and entry.get("mtime", 0) > saved_at:
                log.info("removing %s, written after the restored checkpoint by the run that ended", path)
                trainer.strategy.remove_checkpoint(path)


def _objects(trainer: pl.Trainer, pl_module: pl.LightningModule, callbacks: CallbackStates) -> dict[str, Any]:
    """What a Lightning fit consists of, by name, for the Checkpointer."""
    objects: dict[str, Any] = {
        "model": pl_module,
        "fit_loop": FitLoopState(trainer),
        "precision": trainer.precision_plugin,
        "callbacks": callbacks,
    }
    if trainer.datamodule is not None:
        objects["datamodule"] = trainer.datamodule
    for i, optimizer in enumerate(trainer.optimizers):
        objects[f"optimizer{i}"] = optimizer
    for i, config in enumerate(trainer.lr_scheduler_configs):
        objects[f"scheduler{i}"] = config.scheduler
    return objects
