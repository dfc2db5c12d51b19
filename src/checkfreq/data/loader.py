"""``ResumableLoader``: a DataLoader over a ``ResumableSampler`` whose position is part of the
checkpoint, each sample loaded with generators seeded from (seed, epoch, index)."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from checkfreq.data.order import RESERVED_LOADER_ARGS, check_positive, sample_seed
from checkfreq.data.sampler import ResumableSampler
from checkfreq.errors import ArgumentTypeError, UsageError

log = logging.getLogger("checkfreq.data")


@contextmanager
def _preserved_rng() -> Iterator[None]:
    """Put back Python's, NumPy's and torch's CPU generator states on exit."""
    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)


def _seed_generators(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    torch.default_generator.manual_seed(seed)  # CPU only: torch.manual_seed would also reseed CUDA


class LoaderListener(Protocol):
    """Told of the training loop's moves on a :class:`ResumableLoader` (the Checkpointer listens)."""

    def before_new_pass(self) -> None:
        """The loop asks for a new iterator (the next epoch, a peek) or moves to an epoch: what it did
        after the previous pass's batches (an epoch's own work) is done."""

    def before_batch(self) -> None:
        """The loop asks for the next batch: what it did since the previous one is done."""


class _SeededFetch:
    """The dataset the DataLoader sees: loads ``(index, seed)`` pairs, seeding before each sample."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __getitems__(self, pairs: Sequence[tuple[int, int]]) -> list[Any]:
        with _preserved_rng():
            return [self._fetch(index, seed) for index, seed in pairs]

    def _fetch(self, index: int, seed: int) -> Any:
        _seed_generators(seed)
        return self.dataset[index]


@dataclass
class _BatchPlan:
    """The DataLoader's batch sampler: one pass over ``indices``, each sample as ``(index, seed)``."""

    batch_size: int
    drop_last: bool
    seed: int
    epoch: int = 0
    indices: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        n = len(self.indices)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def size_of(self, batch: int) -> int:
        """Number of samples in batch number ``batch`` of this pass."""
        return min(self.batch_size, len(self.indices) - batch * self.batch_size)

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        size = self.batch_size
        for start in range(0, len(self) * size, size):
            chunk = self.indices[start : start + size]
            yield [(i, sample_seed(self.seed, self.epoch, i)) for i in chunk]


class ResumableLoader:
    """A :class:`torch.utils.data.DataLoader` whose position can be saved and resumed exactly.

    Takes the DataLoader's arguments (with its defaults) plus ``seed``, ``rank``, ``world_size``,
    ``global_batch_size`` (see :class:`ResumableSampler`) and ``micro_batch_size`` (below); other
    keyword arguments (``prefetch_factor``, ``timeout``, ``multiprocessing_context``, ...) go to the
    DataLoader unchanged. ``sampler``, ``batch_sampler``, ``generator`` and ``in_order`` are set by
    the loader itself. Only map-style datasets (``__len__`` and ``__getitem__``) are supported;
    ``dataset[i]`` is called once per sample, after the generators are seeded from ``(seed, epoch, i)``.

    **Epochs.** Iterating yields the rest of the current epoch (all of it after a boundary). Once
    the epoch's last batch is consumed (the loop asks for the next one, or a checkpoint is taken
    after it), :attr:`epoch` moves on by one: the position is then the start of the next epoch,
    and so is that of a loader restored from a checkpoint taken right after an epoch's last batch.
    So ``for epoch in range(loader.epoch, n): for batch in loader:`` continues correctly after any
    restore, and a peek at the next batch (below) always finds one. A ``Checkpointer`` it is
    registered with listens to it (:meth:`add_listener`): the loop asking for a batch or a new pass,
    or moving it to an epoch, is a step's consistent point, where a checkpoint decided at the step
    is captured (docs/exactness.md).

    **State.** :meth:`state_dict` holds the epoch, the samples consumed *by the training loop*
    (batches handed out, not those prefetched by workers) and a fingerprint (dataset length, seed,
    shuffle, world size). Register the loader with the ``Checkpointer`` like any stateful object.
    Restoring with a different ``batch_size``, ``num_workers`` or world size yields each remaining
    sample of the epoch exactly once (see the module documentation for the world-size rule).

    **Global batches.** ``global_batch_size=B`` (instead of the per-rank ``batch_size``) makes the
    optimizer step the unit: the samples of each step are the same at every world size that divides
    ``B``, so a job resumed on fewer or more ranks stays on course. Each rank's slice of a step is
    ``B / world_size`` samples; with ``micro_batch_size=m`` a slice larger than ``m`` is handed out
    as :attr:`accumulation_steps` equal micro-batches of :attr:`batch_size` (at most ``m``) samples,
    whose gradients the training loop accumulates into one optimizer step. Checkpoints must then be
    taken between optimizer steps: :meth:`state_dict` raises ``UsageError`` in the middle of one.

    **Peeking.** A batch counts as consumed when the loop asks for the next one or a checkpoint
    reads :meth:`state_dict`. So ``next(iter(loader))`` (to look at a batch's shape) costs
    nothing: the next iterator starts with that same batch, and ``set_epoch`` with the current
    epoch after it keeps the position.

    An iterator is valid until the next :meth:`__iter__`, :meth:`set_epoch` or
    :meth:`load_state_dict`; using it afterwards raises ``RuntimeError``.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = None,
        shuffle: bool = False,
        drop_last: bool = False,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        worker_init_fn: Callable[[int], None] | None = None,
        *,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        **dataloader_kwargs: Any,
    ) -> None:
        _check_loader_args(dataset, batch_size, global_batch_size, micro_batch_size, dataloader_kwargs)
        self.dataset = dataset
        self._batch_size = 1 if batch_size is None else batch_size
        self._micro_cap = micro_batch_size
        self.sampler = ResumableSampler(
            len(dataset),
            shuffle=shuffle,
            seed=seed,
            rank=rank,
            world_size=world_size,
            drop_last=drop_last,
            global_batch_size=global_batch_size,
        )
        self._plan = _BatchPlan(self._batch_size, drop_last, seed)
        self._loader: DataLoader[Any] = DataLoader(
            _SeededFetch(dataset),  # type: ignore[arg-type]
            batch_sampler=self._plan,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers,
            worker_init_fn=worker_init_fn,
            generator=torch.Generator(),  # worker seeds come from here, not the global RNG
            **dataloader_kwargs,
        )
        self._generation = 0
        self._handed_out = 0
        """Samples of the batch last handed out: consumed once the next batch or a state_dict() is asked for."""
        self._step = _StepProgress()
        self._listeners: list[LoaderListener] = []
        self._holding_back = False

    def add_listener(self, listener: LoaderListener) -> Callable[[], None]:
        """Tell ``listener`` of each new pass and each batch asked for; returns what removes it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self.sampler.epoch

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all ranks (``batch_size × world_size`` without ``global_batch_size``)."""
        if self.sampler.global_batch_size is None:
            return self._batch_size * self.sampler.world_size
        return self.sampler.global_batch_size

    @property
    def batch_size(self) -> int:
        """Samples in each batch this rank yields (a micro-batch when :attr:`accumulation_steps` > 1)."""
        return self._split()[0]

    @property
    def accumulation_steps(self) -> int:
        """Batches this rank yields per optimizer step: accumulate their gradients, then step.

        1 without ``global_batch_size``; with it, the fewest equal micro-batches of at most
        ``micro_batch_size`` samples that make up this rank's slice of a global batch. It depends on
        the world size, so read it after the process group exists (it is fixed by the first pass).
        """
        return self._split()[1]

    def _split(self) -> tuple[int, int]:
        """(batch size, accumulation steps) at the sampler's topology."""
        if self.sampler.global_batch_size is None:
            return self._batch_size, 1
        share = self.sampler.share()
        cap = min(self._micro_cap or share, share)
        steps = next(n for n in range(-(-share // cap), share + 1) if share % n == 0)
        return share // steps, steps

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch`` (the current epoch keeps its position)."""
        for listener in list(self._listeners):
            listener.before_new_pass()
        self._reset_pass()
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        """Batches this rank yields in a whole epoch, as for a DataLoader (a resumed pass yields fewer)."""
        return self._batches(self.sampler.epoch_length())

    def _batches(self, samples: int) -> int:
        """Batches that ``samples`` of this rank's indices make."""
        size = self.batch_size
        return samples // size if self._plan.drop_last else -(-samples // size)

    def _next_epoch_if_over(self) -> None:
        """Move to the start of the next epoch when every batch of the current one has been consumed.

        "Epoch ``e``, all taken" and "epoch ``e + 1``, nothing taken" are the same position; the second
        is the one kept, so that ``epoch`` names the epoch the next batch belongs to and a new
        iterator (a peek) finds a batch.
        """
        if self.sampler.consumed and not self._batches(len(self.sampler)):
            self.sampler.set_epoch(self.sampler.epoch + 1)

    def __iter__(self) -> Iterator[Any]:
        for listener in list(self._listeners):
            listener.before_new_pass()
        self._reset_pass()  # a batch the previous iterator handed out but nobody used: yielded again
        return self._iterate(self._generation)

    def _reset_pass(self) -> None:
        """Invalidate iterators; what was handed out but not consumed, or a partial step, is yielded again."""
        self._handed_out = 0
        self._step = _StepProgress()
        self._generation += 1

    def _iterate(self, generation: int) -> Iterator[Any]:
        self._plan.epoch, self._plan.indices = self.sampler.epoch, self.sampler.rank_indices()
        self._plan.batch_size, self._step.batches = self._split()
        batches = iter(self._loader)
        for number in range(len(self._plan)):
            self._check_current(generation)  # before taking a batch that a newer pass may own
            for listener in list(self._listeners):
                listener.before_batch()
            batch = next(batches)
            self._consume_handed_out()  # asking for this batch means the previous one was used
            self._handed_out = self._plan.size_of(number)
            yield batch
        self._check_current(generation)
        self._consume_handed_out()
        if self.sampler.epoch == self._plan.epoch:  # an epoch with no batch (one that had any moved on above)
            self.sampler.set_epoch(self.sampler.epoch + 1)

    def _consume_handed_out(self) -> None:
        """Count the batch handed out last as consumed (once its optimizer step is complete), unless the
        sampler has moved to another epoch since (``sampler.set_epoch``, as Lightning calls it at the top
        of each epoch): that batch belongs to an epoch that is over."""
        if self._plan.epoch != self.sampler.epoch:
            self._step = _StepProgress(batches=self._step.batches)
        elif self._handed_out and self._step.take(self._handed_out):
            self.sampler.advance(self._step.samples)
            self._step = _StepProgress(batches=self._step.batches)
            self._next_epoch_if_over()
        self._handed_out = 0

    def _check_current(self, generation: int) -> None:
        if generation != self._generation:
            raise UsageError(
                "this ResumableLoader iterator is stale: the loader was iterated again, restored "
                "or moved to another epoch since it was created"
            )

    def state_dict(self) -> dict[str, Any]:
        """Epoch, samples consumed by the training loop, and the topology fingerprint.

        The last batch handed out counts as consumed: a checkpoint is taken after training on it.

        Raises:
            UsageError: the loop is between the micro-batches of one optimizer step (the gradients
                accumulated so far are in no checkpoint).
        """
        if not self._holding_back:
            self._consume_handed_out()
        if self._step.taken:
            raise UsageError(
                f"a checkpoint was asked for after {self._step.taken} of the {self._step.batches} "
                "micro-batches of an optimizer step: the gradients accumulated so far would be in no "
                "checkpoint. Call ckpt.step() once per optimizer step, after optimizer.step()."
            )
        return self.sampler.state_dict()

    @contextmanager
    def hold_back_handed_out(self) -> Iterator[None]:
        """While open, :meth:`state_dict` does not count the batch handed out last as taken: a loop that
        fetched it before the optimizer step a checkpoint follows (a prefetching loop) trains the next
        step on it, so a run resumed from that checkpoint must be handed it again."""
        self._holding_back = True
        try:
            yield
        finally:
            self._holding_back = False

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the saved position; see :meth:`ResumableSampler.load_state_dict`.

        A position after the last batch of an epoch (as earlier versions saved it) is the start of
        the next epoch.
        """
        self.sampler.load_state_dict(state)
        self._next_epoch_if_over()
        self._reset_pass()


@dataclass
class _StepProgress:
    """The batches of the current optimizer step the loop has consumed on this rank."""

    batches: int = 1
    """Batches per optimizer step."""
    taken: int = 0
    samples: int = 0

    def take(self, samples: int) -> bool:
        """Count one consumed batch; ``True`` when it completes the step."""
        self.taken += 1
        self.samples += samples
        return self.taken == self.batches


def _check_loader_args(
    dataset: Any,
    batch_size: int | None,
    global_batch_size: int | None,
    micro_batch_size: int | None,
    extra: Mapping[str, Any],
) -> None:
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise ArgumentTypeError(
            "ResumableLoader needs a map-style dataset (with __len__ and __getitem__); for an "
            "iterable dataset register a loader with its own state_dict(), such as torchdata's "
            "StatefulDataLoader"
        )
    if batch_size is not None and global_batch_size is not None:
        raise ArgumentTypeError(
            "pass batch_size (per rank) or global_batch_size (per optimizer step, over all ranks), not both; "
            "with global_batch_size, cap each rank's batches with micro_batch_size"
        )
    if micro_batch_size is not None and global_batch_size is None:
        raise ArgumentTypeError("micro_batch_size caps the slices of global_batch_size; pass global_batch_size too")
    for name, value in (("batch_size", batch_size), ("micro_batch_size", micro_batch_size)):
        if value is not None:
            check_positive(name, value)
    reserved = sorted(RESERVED_LOADER_ARGS.intersection(extra))
    if reserved:
        raise ArgumentTypeError(f"ResumableLoader sets {reserved} itself; they cannot be passed")
