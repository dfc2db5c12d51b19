"""The data order of a ``CheckFreqTrainer`` run: checkfreq's :class:`~checkfreq.data.ResumableSampler`
(an order that is a pure function of (seed, epoch)) or, for a run begun with the plain ``Trainer``,
the Trainer's own seeded sampler; and the note in the Trainer's ``checkpoint-N/`` directories that
names the order their run was trained in (docs/huggingface.md)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader

from checkfreq.data import ResumableSampler
from checkfreq.errors import CorruptCheckpointError, UsageError

log = logging.getLogger("checkfreq.integrations.transformers")

ORDER_NOTE = "checkfreq.json"  # in the checkpoint-N/ directories CheckFreqTrainer saves: the data order
CHECKFREQ_ORDER = "checkfreq"  # a ResumableSampler's
TRAINER_ORDER = "trainer"  # the Trainer's own (accelerate's seeded sampler), for runs begun with the plain Trainer


class EpochLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ResumableSampler` that forwards the Trainer's ``set_epoch``."""

    def __init__(
        self, dataset: Any, sampler: ResumableSampler, batch_size: int, drop_last: bool, **options: Any
    ) -> None:
        super().__init__(dataset, batch_sampler=BatchSampler(sampler, batch_size, drop_last), **options)
        self.resumable_sampler = sampler

    def set_epoch(self, epoch: int) -> None:
        self.resumable_sampler.set_epoch(epoch)


def order_of(checkpoint: Path) -> str:
    """The data order of the run that saved the Trainer checkpoint ``checkpoint``: the one its note
    names, or, without a note, the plain Trainer's own."""
    note = checkpoint / ORDER_NOTE
    if note.is_file():
        order = json.loads(note.read_text())["data_order"]
        if order not in (CHECKFREQ_ORDER, TRAINER_ORDER):
            raise CorruptCheckpointError(f"{note} names an unknown data order {order!r}")
        return str(order)
    log.warning(
        "%s holds no %s, so the plain Trainer saved it: the run goes on in the Trainer's own data order, as its own "
        "resume would (the rest of the epoch without the batches it already trained), and checkfreq's checkpoints "
        "keep that order from now on",
        checkpoint,
        ORDER_NOTE,
    )
    return TRAINER_ORDER


def seeded_trainer_loader(loader: DataLoader) -> DataLoader:
    """The Trainer's own train loader, once it is known to draw an order a later resume draws again:
    accelerate's seeded sampler (an order that is a function of the seed and the epoch) or a sequential one."""
    from accelerate.data_loader import SeedableRandomSampler

    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(getattr(batch_sampler, "batch_sampler", batch_sampler), "sampler", None)
    if not isinstance(sampler, (SeedableRandomSampler, torch.utils.data.SequentialSampler)):
        raise UsageError(
            f"this run began with the plain Trainer, whose data order CheckFreqTrainer keeps; its train sampler "
            f"{type(sampler).__name__} draws an order that a resume from a checkfreq checkpoint could not draw again. "
            "Keep accelerator_config's use_seedable_sampler=True (the default) and train_sampling_strategy 'random' or "
            "'sequential'; or finish the run with the plain Trainer and start the next one with CheckFreqTrainer."
        )
    return loader
