"""Hugging Face ``transformers``: checkfreq's checkpointing inside ``Trainer``.

:class:`CheckFreqTrainer` is a ``transformers.Trainer`` that checkpoints with a
:class:`~checkfreq.Checkpointer` after each optimizer step (once the step's logging and
evaluation are done, as the policy decides) and resumes from the newest valid checkpoint with
``trainer.train(resume_from_checkpoint=True)``:

* the model, the optimizer (Accelerate's wrapper included), the LR scheduler, each rank's random
  generators and the Trainer's own state (``global_step``, ``epoch``, log and evaluation history,
  the loss accumulated since the last log, stateful callbacks) are restored;
* the Trainer reads the restored ``global_step`` to compute where the epoch stands, and its
  fast-forward then steps over index lists of a :class:`~checkfreq.data.ResumableSampler` whose
  order is a pure function of (seed, epoch): no sample is read, collated or sent to a worker
  again;
* :meth:`CheckFreqTrainer.export_checkpoint` writes a checkpoint in the ``checkpoint-N/`` layout
  (``model.safetensors``, ``config.json``, ``trainer_state.json``) that ``from_pretrained`` reads.

See docs/huggingface.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerState
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import get_last_checkpoint

from checkfreq.checkpointer import CHECKPOINTER_OPTIONS, Checkpointer
from checkfreq.data import ResumableSampler
from checkfreq.errors import CorruptCheckpointError, InvalidArgumentError, NoValidCheckpointError, UsageError
from checkfreq.integrations.best import best_retention
from checkfreq.integrations.loss import LossFeed
from checkfreq.integrations.transformers_order import (
    CHECKFREQ_ORDER,
    ORDER_NOTE,
    TRAINER_ORDER,
    EpochLoader,
    order_of,
    seeded_trainer_loader,
)
from checkfreq.integrations.transformers_pick import best_metric, chosen_step, named_step
from checkfreq.pipeline.restore import read_checkpoint
from checkfreq.policies import Policy
from checkfreq.policies.retention import Retention
from checkfreq.ranks.rebuild import local_view
from checkfreq.run.options import check_names
from checkfreq.run.state import unflatten
from checkfreq.storage.local import LocalStore

log = logging.getLogger("checkfreq.integrations.transformers")

TRAINER_STATE = "trainer_state.json"


class TrainerProgress:
    """The Trainer's own state (``TrainerState`` and the loss accumulated since the last log) as a stateful object."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self._trainer
        return {
            "trainer_state": _state_json(t),
            "tr_loss": t._tr_loss.detach(),
            "total_loss_scalar": t._total_loss_scalar,
            "globalstep_last_logged": t._globalstep_last_logged,
            "initial_global_step": t._initial_global_step,
            "current_flos": float(t.current_flos),
            "global_batch_size": _global_batch_size(t),
            "data_order": t._data_order,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        t = self._trainer
        saved, now = state.get("global_batch_size"), _global_batch_size(t)
        if saved is not None and int(saved) != now:  # absent in checkpoints of earlier versions
            raise UsageError(
                f"the checkpoint's optimizer steps took {int(saved)} samples each (per-device batch x processes x "
                f"gradient accumulation), this run's take {now}: the Trainer derives the data position from the "
                "step count, so the rest of the run would take other samples. Keep per_device_train_batch_size x "
                f"processes x gradient_accumulation_steps = {int(saved)} (e.g. double gradient_accumulation_steps "
                "when the processes halve)."
            )
        t._tr_loss = state["tr_loss"].clone().to(t.args.device)
        t._total_loss_scalar = state["total_loss_scalar"]
        t._globalstep_last_logged = state["globalstep_last_logged"]
        t._initial_global_step = state["initial_global_step"]
        t.current_flos = state["current_flos"]


def _global_batch_size(trainer: Trainer) -> int:
    """Samples per optimizer step over all processes."""
    args = trainer.args
    return trainer._train_batch_size * max(1, args.world_size) * args.gradient_accumulation_steps


class CheckFreqTrainer(Trainer):
    """A ``transformers.Trainer`` checkpointed by checkfreq: frequent, cheap, exact to resume.

    Args:
        *args, **kwargs: those of ``transformers.Trainer``.
        checkfreq_dir: where checkpoints go (default ``<output_dir>/checkfreq``).
        checkfreq_policy: when to checkpoint (see :class:`~checkfreq.Checkpointer`), in optimizer steps.
        checkfreq_keep: committed checkpoints to keep (default ``args.save_total_limit``, else 3), or a
            :class:`~checkfreq.Retention`. With ``args.metric_for_best_model``, the best checkpoint by that
            evaluation metric (``greater_is_better`` says which way) is kept too, however old.
        checkfreq_options: further :class:`~checkfreq.Checkpointer` options (``remote``, ``on_error``, ...);
            any other name raises ``TypeError`` naming the closest option.

    ``train(resume_from_checkpoint=True)`` resumes from the newest valid checkfreq checkpoint, and
    starts afresh when there is none, so the same command serves the first run and every restart;
    the strings ``"true"``/``"false"`` (``--resume_from_checkpoint true`` parsed by
    ``HfArgumentParser``) count as the booleans. A path still resumes from one of the Trainer's own
    ``checkpoint-N/`` directories, and checkfreq counts on from its ``global_step``; the path of a
    checkpoint of ``checkfreq_dir`` (``<checkfreq_dir>/step_N``) resumes from that one, and ``"best"``
    from the best by ``metric_for_best_model``. Without ``True``, a ``checkfreq_dir`` that holds
    checkpoints raises :class:`~checkfreq.errors.ExistingCheckpointsError` when ``train()`` starts.
    """

    def __init__(
        self,
        *args: Any,
        checkfreq_dir: str | os.PathLike[str] | None = None,
        checkfreq_policy: Policy | str | int = "auto",
        checkfreq_keep: int | Retention | None = None,
        checkfreq_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        forwarded = [name for name in CHECKPOINTER_OPTIONS if name not in ("policy", "keep")]
        check_names("CheckFreqTrainer", checkfreq_options or {}, forwarded)
        super().__init__(*args, **kwargs)
        self.checkfreq_dir = Path(
            checkfreq_dir if checkfreq_dir is not None else Path(self.args.output_dir) / "checkfreq"
        )
        metric, mode = best_metric(self.args)  # keep the best by it too, with metric_for_best_model
        keep = best_retention(
            checkfreq_keep or self.args.save_total_limit or 3,
            metric,
            mode,
            1 if metric else None,
            names=("metric_for_best_model", "greater_is_better", "top"),
        )
        self._best = keep.metric if isinstance(keep, Retention) else None
        self._evaluated: Any = None  # the best metric's value in the evaluation of a step not yet counted
        self._checkfreq_settings = dict(policy=checkfreq_policy, keep=keep, **(checkfreq_options or {}))
        self._resume_at: int | str | None = None  # a step of checkfreq_dir named as resume_from_checkpoint
        self._checkpointer: Checkpointer | None = None
        self._resume = False
        self._resume_step = 0  # the checkpoint being resumed from, restored at the first batch fetch
        self._from_checkfreq = False  # this fit resumes from a checkfreq checkpoint (its RNG state too)
        self._saved_state: dict[str, Any] = {}  # its TrainerState, put in place before the Trainer reads it
        self._train_sampler: ResumableSampler | None = None
        self._data_order = CHECKFREQ_ORDER  # or TRAINER_ORDER: the Trainer's own sampler (see _inner_training_loop)
        self._resume_mid_epoch = False
        self._counted_step = 0
        self._end_of_epoch_pending = False
        self._step_loss: torch.Tensor | None = None  # this optimizer step's loss, summed over its micro-batches
        self._loss = LossFeed()
        self.restored_step = 0
        """The optimizer step the last ``train()`` resumed from, from checkfreq or a ``checkpoint-N/``
        (0 for a fresh run)."""

    @property
    def checkpointer(self) -> Checkpointer:
        """The :class:`~checkfreq.Checkpointer` of the running ``train()``."""
        if self._checkpointer is None:
            raise UsageError("CheckFreqTrainer has no checkpointer outside train()")
        return self._checkpointer

    # ------------------------------------------------------------------ Trainer hooks

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() in ("true", "false"):
            # ``--resume_from_checkpoint true`` parsed by HfArgumentParser: TrainingArguments holds a string
            resume_from_checkpoint = resume_from_checkpoint.lower() == "true"
        self._resume_at = named_step(resume_from_checkpoint, self.checkfreq_dir)
        if self._resume_at is not None:  # a checkfreq checkpoint, by its path or "best": the Trainer's resume from it
            resume_from_checkpoint = True
        self._resume = resume_from_checkpoint is True
        if self._resume and self._resume_at is None and not _holds_checkpoints(self.checkfreq_dir):
            theirs = _newest_trainer_checkpoint(self.args.output_dir)
            if theirs is not None:  # as the plain Trainer's resume_from_checkpoint=True: its checkpoint-N/
                log.warning(
                    "%s holds no checkfreq checkpoint: resuming from the Trainer's newest checkpoint, %s (step %d)",
                    self.checkfreq_dir,
                    theirs[0],
                    theirs[1],
                )
                self._resume, resume_from_checkpoint = False, str(theirs[0])
        return super().train(None if self._resume else resume_from_checkpoint or None, *args, **kwargs)

    def _inner_training_loop(self, *args: Any, **kwargs: Any) -> Any:
        self._resume_step = self.restored_step = 0
        self._from_checkfreq = False
        self._data_order = CHECKFREQ_ORDER
        if self._resume:
            found = _resume_point(self.checkfreq_dir, chosen_step(self.checkfreq_dir, self._resume_at))
            if found is not None:  # the Trainer's resume path, fed from the checkfreq checkpoint
                self._resume_step, path, self._saved_state, self._data_order = found
                self.restored_step = self._resume_step
                self._from_checkfreq = True
                kwargs["resume_from_checkpoint"] = str(path)
                _note_newer_trainer_checkpoint(self.args.output_dir, self._resume_step)
        elif kwargs.get("resume_from_checkpoint") and Path(kwargs["resume_from_checkpoint"]).is_dir():
            self._data_order = order_of(Path(kwargs["resume_from_checkpoint"]))  # one of the Trainer's checkpoint-N/
        try:
            return super()._inner_training_loop(*args, **kwargs)
        finally:
            checkpointer, self._checkpointer = self._checkpointer, None
            if checkpointer is not None:
                checkpointer.close()

    def get_train_dataloader(self) -> DataLoader:
        """The training data in an order that is a pure function of (seed, epoch), split over the ranks:
        checkfreq's :class:`ResumableSampler`, or the Trainer's own seeded sampler for a run that began
        with the plain ``Trainer``."""
        self._train_sampler = None
        if self._data_order == TRAINER_ORDER:
            return seeded_trainer_loader(super().get_train_dataloader())
        dataset, collator = self.train_dataset, self.data_collator
        if self.args.train_sampling_strategy not in ("random", "sequential"):
            raise InvalidArgumentError(
                f"CheckFreqTrainer draws batches in a resumable order; train_sampling_strategy="
                f"{self.args.train_sampling_strategy!r} is not supported (use 'random' or 'sequential')"
            )
        if not hasattr(dataset, "__len__") or isinstance(dataset, torch.utils.data.IterableDataset):
            raise InvalidArgumentError(
                "CheckFreqTrainer needs a map-style train_dataset (with __len__ and __getitem__)"
            )
        if hasattr(dataset, "column_names"):  # a datasets.Dataset
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        world_size = max(1, self.args.world_size)
        self._train_sampler = ResumableSampler(
            len(dataset),
            shuffle=self.args.train_sampling_strategy != "sequential",
            seed=seed,
            rank=self.args.process_index if world_size > 1 else 0,
            world_size=world_size,
            drop_last=self.args.dataloader_drop_last,
        )
        return EpochLoader(
            dataset,
            self._train_sampler,
            self._train_batch_size,
            self.args.dataloader_drop_last,
            collate_fn=collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            generator=torch.Generator().manual_seed(seed),  # a new iterator draws nothing from the global generator
        )

    def _init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint: str | None,
        trial: Any,
    ) -> tuple[int, int]:
        epochs_trained, batches_done = super()._init_training_state(
            max_steps,
            num_update_steps_per_epoch,
            num_train_epochs,
            None if self._resume_step else resume_from_checkpoint,
            trial,
        )
        if self._resume_step:  # the Trainer computes the data position from its state: put the saved one in place now
            self.state = TrainerState(**self._saved_state)
            self.state.init_training_references(self, max_steps, num_train_epochs, trial)
            self._load_callback_state()
            epochs_trained = self.state.global_step // num_update_steps_per_epoch
            batches_done = self.state.global_step % num_update_steps_per_epoch * self.args.gradient_accumulation_steps
        self._resume_mid_epoch = batches_done > 0 and not self.args.ignore_data_skip
        if self._train_sampler is not None:  # the Trainer's fast-forward does not set the epoch
            self._train_sampler.set_epoch(epochs_trained)
        return epochs_trained, batches_done

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        model, train_dataloader = super()._prepare_for_training(*args, **kwargs)
        objects: dict[str, Any] = {"model": self.model, "optimizer": self.optimizer, "trainer": TrainerProgress(self)}
        if self.lr_scheduler is not None:
            objects["scheduler"] = self.lr_scheduler
        if self.accelerator.scaler is not None:
            objects["scaler"] = self.accelerator.scaler
        self._checkpointer = Checkpointer(self.checkfreq_dir, **self._checkfreq_settings, **objects)
        if not self._resume_step:  # a fresh run, or one resumed from a Trainer checkpoint-N/: count from its step
            self.restored_step = self.state.global_step
            self._checkpointer.start_at(self.state.global_step)  # and refuse a directory holding checkpoints now
        self._counted_step = self.state.global_step
        self._end_of_epoch_pending = False
        return model, train_dataloader

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's ``checkpoint-N/``, with a note of the data order it was trained in (see
        :func:`~checkfreq.integrations.transformers_order.order_of`), written before the Trainer's
        ``trainer_state.json``, which it writes last."""
        if self.args.should_save:
            folder = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / ORDER_NOTE).write_text(json.dumps({"data_order": self._data_order}) + "\n")
        super()._save_checkpoint(model, trial)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not self._from_checkfreq:  # the Trainer's own checkpoint
            super()._load_rng_state(checkpoint)
        # else: the generators came back with the rest, right before the first batch was drawn; a
        # mid-epoch resume asks again after it, where the Trainer would warn of an RNG file missing

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device: torch.device) -> tuple[list, Any]:
        # Restored here, after the Trainer set up the epoch and before anything is drawn from the
        # data or the generators: the next draw is the one the interrupted run made next. The
        # Trainer's own loader draws its iterator's seed from the global generator at its first batch,
        # which the interrupted run did at the epoch's start: mid-epoch, restore after that draw (as
        # the Trainer's own resume loads its RNG file after it).
        if self._data_order == TRAINER_ORDER and self._resume_mid_epoch:
            batches = super().get_batch_samples(epoch_iterator, num_batches, device)
            self._restore_pending()
            return batches
        self._restore_pending()
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        self._restore_pending()  # resumed from the last step: no batch was drawn
        output = super()._finalize_training(*args, **kwargs)
        self.checkpointer.save(blocking=True)  # the final state, unless the last step's checkpoint holds it
        return output

    def _restore_pending(self) -> None:
        if not self._resume_step:
            return
        step, self._resume_step = self._resume_step, 0
        self.checkpointer.restore(step)
        self._counted_step = self.state.global_step
        log.info("resumed from checkfreq checkpoint at step %d (epoch %.4f)", step, self.state.epoch)

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)  # a micro-batch's share of the step's loss
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss
        return loss

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        super()._maybe_log_save_evaluate(*args, **kwargs)
        if self._checkpointer is None:
            return
        if self.state.global_step != self._counted_step:  # after an optimizer step's log and evaluation
            self._counted_step = self.state.global_step
            self._loss.push(self._step_loss)  # for convergence-aware policies, without a device sync
            self._step_loss = None
            if float(self.state.epoch).is_integer():  # an epoch's last step: its end-of-epoch evaluation comes first
                self._end_of_epoch_pending = True
                return
            self._checkpointer.step(loss=self._loss.take())
        elif self._end_of_epoch_pending:  # the end-of-epoch call that follows an epoch's last step
            self._end_of_epoch_pending = False
            self._checkpointer.step(loss=self._loss.take())
        if self._evaluated is not None:  # the evaluation of the step counted scores its checkpoint (keep the best)
            self._checkpointer.log(**{str(self._best): self._evaluated})
            self._evaluated = None
        self._checkpointer.consistent_point()  # the Trainer's step, its logging and evaluation included, ends here

    def _evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        metrics: dict[str, float] = super()._evaluate(*args, **kwargs)
        if self._best is not None and self._checkpointer is not None and metrics.get(self._best) is not None:
            self._evaluated = metrics[self._best]
        return metrics

    # ------------------------------------------------------------------ export

    def export_checkpoint(self, output_dir: str | os.PathLike[str] | None = None, step: int | None = None) -> Path:
        """Write checkfreq checkpoint ``step`` (default: the newest valid one) as a ``checkpoint-N/`` directory.

        The directory holds ``model.safetensors`` and the model's ``config.json`` (what
        ``from_pretrained`` reads) and the Trainer's ``trainer_state.json``. Only the main process
        writes; every process returns the path once it is written.
        """
        if step is None:
            found = _resume_point(self.checkfreq_dir)
            if found is None:
                raise NoValidCheckpointError(f"no valid checkpoint in {self.checkfreq_dir}")
            step = found[0]
        target = Path(output_dir if output_dir is not None else self.args.output_dir) / f"checkpoint-{step}"
        if self.args.should_save:
            skeleton, tensors = _checkpoint_view(self.checkfreq_dir, step)
            weights = unflatten(skeleton["model"], tensors)
            model = self.accelerator.unwrap_model(self.model)
            model.save_pretrained(target, state_dict={k: v.clone() for k, v in weights.items()})
            progress = unflatten(skeleton["trainer"], tensors)
            (target / TRAINER_STATE).write_text(progress["trainer_state"])
            (target / ORDER_NOTE).write_text(json.dumps({"data_order": progress.get("data_order", CHECKFREQ_ORDER)}))
            log.info("exported checkfreq checkpoint %d to %s", step, target)
        self.accelerator.wait_for_everyone()  # no process reads the export before it is written
        return target


def _state_json(trainer: Trainer) -> str:
    """The Trainer's state as the JSON of its ``trainer_state.json``, with the callbacks' current state."""
    state = dataclasses.replace(trainer.state, stateful_callbacks={})
    stateful = [cb for cb in trainer.callback_handler.callbacks + [trainer.control] if isinstance(cb, ExportableState)]
    state.stateful_callbacks = TrainerState(stateful_callbacks=stateful).stateful_callbacks
    return json.dumps(dataclasses.asdict(state), sort_keys=True)


def _resume_point(directory: Path, only: int | None = None) -> tuple[int, Path, dict[str, Any], str] | None:
    """(step, path, saved TrainerState, data order) of the newest checkpoint in ``directory`` that verifies
    (or of step ``only``), or None when it holds none; :class:`NoValidCheckpointError` when it holds some but
    none verifies (or not ``only``)."""
    if not directory.is_dir():
        return None
    store = LocalStore(directory, create=False)
    skipped = []
    for step, path in store.checkpoints():
        if only is not None and step != only:
            continue
        try:
            manifest, tensors = read_checkpoint(path, store)
        except CorruptCheckpointError as e:  # the Checkpointer skips it the same way
            log.warning("skipping checkpoint %s: %s", path.name, e)
            skipped.append(f"{path.name}: {e}")
            continue
        skeleton, tensors = local_view(manifest, tensors)
        progress = unflatten(skeleton["trainer"], tensors)
        return step, path, json.loads(progress["trainer_state"]), progress.get("data_order", CHECKFREQ_ORDER)
    if skipped or only is not None:
        what = "no valid checkpoint" if only is None else f"no valid checkpoint for step {only}"
        raise NoValidCheckpointError(f"{what} in {directory}" + (f" ({'; '.join(skipped)})" if skipped else ""))
    return None


def _checkpoint_view(directory: Path, step: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The skeleton and whole tensors of checkpoint ``step`` (pieces written by several ranks joined)."""
    store = LocalStore(directory, create=False)
    path = next((p for s, p in store.checkpoints() if s == step), None)
    if path is None:
        raise NoValidCheckpointError(f"no checkpoint for step {step} in {directory}")
    manifest, tensors = read_checkpoint(path, store)
    return local_view(manifest, tensors)


def _holds_checkpoints(directory: Path) -> bool:
    """Whether ``directory`` holds checkfreq checkpoints, valid or not."""
    return directory.is_dir() and any(True for _ in LocalStore(directory, create=False).checkpoints())


def _newest_trainer_checkpoint(output_dir: str | os.PathLike[str]) -> tuple[Path, int] | None:
    """(path, global_step) of the newest ``checkpoint-N/`` the Trainer finished writing in ``output_dir``."""
    newest = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    if newest is None or not (Path(newest) / TRAINER_STATE).is_file():  # its state is written last
        return None
    return Path(newest), int(json.loads((Path(newest) / TRAINER_STATE).read_text())["global_step"])


def _note_newer_trainer_checkpoint(output_dir: str | os.PathLike[str], step: int) -> None:
    """Say so when the Trainer saved a ``checkpoint-N/`` newer than checkfreq checkpoint ``step``."""
    found = _newest_trainer_checkpoint(output_dir)
    if found is None:
        return
    newest, theirs = found
    if theirs > step:
        log.warning(
            "resuming from checkfreq's newest checkpoint, step %d, though the Trainer's %s (step %d) is newer: "
            "checkfreq's is verified by its checksums and holds the whole state (the loss accumulated since the "
            "last log included), so the %d steps after it are trained again to the same result. To resume from %s "
            "instead, pass its path as resume_from_checkpoint, with a checkfreq_dir of its own.",
            step,
            newest,
            theirs,
            theirs - step,
            newest,
        )
