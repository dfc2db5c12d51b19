"""Resumable data loading: each sample exactly once per epoch, in the same order, after any restart.

Three rules make a resumed run see exactly what an uninterrupted one would have seen:

* **Order is a pure function.** The *global order* of epoch ``e`` is a permutation of
  ``range(len(dataset))`` computed from ``(seed, e)`` alone (the identity when ``shuffle=False``).
  Rank ``r`` of ``W`` takes every ``W``-th entry starting at ``r``, like
  :class:`torch.utils.data.DistributedSampler`. No generator carries state from one epoch to the next.
* **State is a position, not a history.** :class:`ResumableSampler` keeps ``epoch`` and
  ``consumed``: how many entries of the epoch's global order the training loop has consumed on all
  ranks together. Because ranks stride over the order and step in lockstep, the consumed samples
  are always the prefix ``order[:consumed]``. Resuming starts at ``order[consumed]`` directly: the
  skipped samples are never read, so resuming mid-epoch costs the same as resuming at its start.
* **Randomness is per sample.** Before ``dataset[i]`` is called, Python's ``random``, NumPy's global
  generator and torch's CPU generator are seeded from ``(seed, epoch, i)``, so a random augmentation
  of sample ``i`` is the same whichever worker loads it, with any ``num_workers``, before or after a
  restart. In the main process (``num_workers=0``) the caller's generator states are put back
  afterwards: loading data never disturbs the training loop's random stream.

**Changing the world size.** The remainder of the epoch, ``order[consumed:]``, is re-partitioned
over the new ranks (rank ``r`` of ``W'`` takes ``order[consumed + r :: W']``), so every sample of the
epoch is still seen exactly once. When the remainder is not a multiple of the world size, every
rank still takes the same number of samples, as with ``DistributedSampler``: ``drop_last=False``
repeats the first few remaining samples (at most ``W - 1``) and ``drop_last=True`` leaves the last
few out. With one rank nothing is ever repeated or left out by the sampler.

**Global batches.** With ``global_batch_size=B`` the unit is the optimizer step, whatever the world
size: global batch ``k`` of an epoch is ``order[k*B : (k+1)*B]`` (a tail shorter than ``B`` is left
out with ``drop_last=True``, else completed with the epoch's first samples), and rank ``r`` of ``W``
takes its ``r``-th of ``W`` equal consecutive slices. Which samples make optimizer step ``k``
therefore depends on ``(seed, epoch, B)`` alone; a job resumed at another world size takes the same
global batches from the step where it stopped. A rank's slice that exceeds ``micro_batch_size``
is handed out in equal micro-batches, :attr:`ResumableLoader.accumulation_steps` of them per step.
"""

from __future__ import annotations

import logging
import operator
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, Sampler

from checkfreq.errors import ArgumentTypeError, InvalidArgumentError, TopologyError, UsageError

__all__ = ["ResumableLoader", "ResumableSampler", "sample_seed"]

_MASK64 = (1 << 64) - 1
_ORDER_DOMAIN = 0
_SAMPLE_DOMAIN = 1
_FINGERPRINT_KEYS = ("dataset_length", "seed", "shuffle")
_RESERVED_LOADER_ARGS = frozenset({"sampler", "batch_sampler", "generator", "in_order"})

log = logging.getLogger("checkfreq.data")


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix(*words: int) -> int:
    """A 63-bit seed that depends on every word (well spread, cheap, stable across versions)."""
    h = 0
    for word in words:
        h = _splitmix64(h ^ (word & _MASK64))
    return h >> 1


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed the generators are set to before ``dataset[index]`` is loaded in ``epoch``."""
    return _mix(_SAMPLE_DOMAIN, seed, epoch, index)


def _job_topology() -> tuple[int, int] | None:
    """(rank, world size) of the torch.distributed job, or ``None`` when no process group is initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def _check_topology(rank: int, world_size: int) -> tuple[int, int]:
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidArgumentError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size


class ResumableSampler(Sampler[int]):
    """This rank's sample indices for an epoch, starting at the first one not yet consumed.

    Args:
        length: number of samples in the dataset.
        shuffle: permute the order each epoch (from ``seed`` and the epoch number); else keep it.
        seed: the run's data seed; the only source of the order and of per-sample seeds.
        rank, world_size: this process's place among the data-parallel ranks. Given, they are used
            as they are (e.g. a data-parallel group smaller than the job). Left out, they are taken
            from ``torch.distributed`` when the first pass starts (``0`` and ``1`` without a
            process group) and then kept; a later pass in a job whose rank or world size differs
            raises :class:`~checkfreq.errors.TopologyError`. So a loader may be built before
            ``init_process_group``.
        drop_last: when the rest of the epoch does not split evenly over the ranks, leave the last
            samples out instead of repeating the first ones (no effect with one rank). With
            ``global_batch_size``: leave out a last global batch shorter than ``global_batch_size``
            instead of completing it with the epoch's first samples.
        global_batch_size: the samples of one optimizer step over all ranks together. Given, the
            epoch is cut into global batches that do not depend on the world size, and each rank
            takes its slice of each (the module documentation has the rule); the world size must
            divide it, else the first pass raises :class:`~checkfreq.errors.TopologyError`.

    The sampler does not see what the training loop consumes: whoever drives it (normally
    :class:`ResumableLoader`) reports that with :meth:`advance`, and moves epochs with
    :meth:`set_epoch`.
    """

    def __init__(
        self,
        length: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        global_batch_size: int | None = None,
    ) -> None:
        if length < 0:
            raise InvalidArgumentError(f"dataset length must be >= 0, got {length}")
        if global_batch_size is not None:
            _check_positive("global_batch_size", global_batch_size)
        self.length = length
        self.shuffle = shuffle
        self.seed = seed
        self._given = (rank, world_size)
        if rank is not None and world_size is not None:
            _check_topology(rank, world_size)
        self._bound: tuple[int, int] | None = None
        """(rank, world size) fixed when the first pass started."""
        self.drop_last = drop_last
        self.global_batch_size = global_batch_size
        self.epoch = 0
        self.consumed = 0
        """Entries of this epoch's global order consumed by all ranks together."""

    @property
    def rank(self) -> int:
        """This process's rank among the data-parallel ranks (see :meth:`topology`)."""
        return self.topology()[0]

    @property
    def world_size(self) -> int:
        """The number of data-parallel ranks (see :meth:`topology`)."""
        return self.topology()[1]

    def topology(self) -> tuple[int, int]:
        """(rank, world size): as given, as fixed by the first pass, or else the job's as it is now."""
        if self._bound is not None:
            return self._bound
        return self._fill(_job_topology() or (0, 1))

    def _fill(self, job: tuple[int, int]) -> tuple[int, int]:
        """The given rank and world size, the job's where not given."""
        rank, world_size = self._given
        return _check_topology(job[0] if rank is None else rank, job[1] if world_size is None else world_size)

    def bind(self) -> tuple[int, int]:
        """Fix the topology at the start of a pass; raise if the job's no longer matches the one fixed.

        Raises:
            TopologyError: the first pass ran with another rank or world size than the job has now
                (typically: it ran before ``init_process_group``).
        """
        if self._bound is None:
            self._bound = self.topology()
            return self._bound
        job = _job_topology()
        if job is not None and self._fill(job) != self._bound:
            raise TopologyError(
                f"this loader partitions its samples for rank {self._bound[0]} of {self._bound[1]}, but the "
                f"job now has rank {job[0]} of {job[1]} (did its first pass run before init_process_group?). "
                "Iterate it only after init_process_group, or pass rank and world_size."
            )
        return self._bound

    def global_order(self, epoch: int) -> torch.Tensor:
        """The order of every sample of ``epoch`` over all ranks: a pure function of (seed, epoch)."""
        if not self.shuffle:
            return torch.arange(self.length)
        generator = torch.Generator().manual_seed(_mix(_ORDER_DOMAIN, self.seed, epoch))
        return torch.randperm(self.length, generator=generator)

    def share(self) -> int:
        """Samples of each global batch that one rank takes: ``global_batch_size / world_size``.

        Raises:
            TopologyError: the world size does not divide ``global_batch_size``.
        """
        if self.global_batch_size is None:
            raise UsageError("share() needs a sampler built with global_batch_size")
        world_size = self.world_size
        if self.global_batch_size % world_size:
            raise TopologyError(
                f"global_batch_size={self.global_batch_size} does not split over {world_size} ranks: every "
                "rank must take the same number of samples of each global batch. Choose a global batch "
                "size that every world size the job may run at divides (a multiple of their least common "
                "multiple), or run at a world size that divides it."
            )
        return self.global_batch_size // world_size

    def _global_batches(self, remaining: int) -> int:
        """How many global batches the next ``remaining`` entries of the order make."""
        size = self.global_batch_size
        assert size is not None
        return remaining // size if self.drop_last else -(-remaining // size)

    def _per_rank(self, remaining: int) -> int:
        if self.global_batch_size is not None:
            return self._global_batches(remaining) * self.share()
        if self.drop_last:
            return remaining // self.world_size
        return -(-remaining // self.world_size)

    def rank_indices(self) -> list[int]:
        """The indices this rank yields from the current position to the end of the epoch (starts a pass)."""
        rank, world_size = self.bind()
        order = self.global_order(self.epoch)
        if self.global_batch_size is not None:
            return self._rank_slices(order, rank)
        rest = order[self.consumed :]
        total = self._per_rank(len(rest)) * world_size
        if total > len(rest):
            rest = rest[torch.arange(total) % len(rest)]
        return rest[rank:total:world_size].tolist()

    def _rank_slices(self, order: torch.Tensor, rank: int) -> list[int]:
        """This rank's slice of every remaining global batch, in step order."""
        size, share = self.global_batch_size, self.share()
        assert size is not None
        batches = self._global_batches(self.length - self.consumed)
        if batches == 0:
            return []
        positions = self.consumed + torch.arange(batches * size).view(batches, size)
        positions = positions[:, rank * share : (rank + 1) * share].reshape(-1)
        return order[positions % self.length].tolist()  # past the end: the epoch's first samples again

    def epoch_length(self) -> int:
        """How many indices this rank yields in a whole epoch at the current world size."""
        return self._per_rank(self.length)

    def __iter__(self) -> Iterator[int]:
        return iter(self.rank_indices())

    def __len__(self) -> int:
        """How many indices :meth:`__iter__` yields from the current position."""
        return self._per_rank(self.length - self.consumed)

    def advance(self, samples: int) -> None:
        """Record that each rank's training loop consumed ``samples`` more of its indices.

        With ``global_batch_size``, report whole steps (multiples of :meth:`share`): a position
        inside a global batch would not be one at another world size.
        """
        self.consumed = min(self.length, self.consumed + samples * self.world_size)

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch``; a call with the current epoch keeps the position.

        Keeping the position makes the ``DistributedSampler`` habit of calling
        ``set_epoch(epoch)`` at the top of each epoch safe after a mid-epoch restore.
        """
        if epoch < 0:
            raise InvalidArgumentError(f"epoch must be >= 0, got {epoch}")
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        """Position and topology fingerprint, as JSON-able plain values.

        ``global_batch_size`` is there only when the sampler has one, so the state of a sampler
        without one is what earlier versions saved.
        """
        state = {
            "epoch": self.epoch,
            "consumed": self.consumed,
            "dataset_length": self.length,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "world_size": self.world_size,
        }
        if self.global_batch_size is not None:
            state["global_batch_size"] = self.global_batch_size
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict`, at this or another world size.

        A state saved without ``global_batch_size`` (per-rank batches, or an earlier version) loads
        into a sampler with one only at a global-batch boundary (``consumed`` a multiple of it, or
        the whole epoch): the consumed samples are the same prefix of the order either way.

        Raises:
            ValueError: the state is malformed or was saved for another dataset length, seed,
                shuffle setting or global batch size (the saved position would then mean other
                samples or other optimizer steps).
        """
        missing = [k for k in ("epoch", "consumed", *_FINGERPRINT_KEYS) if k not in state]
        if missing:
            raise InvalidArgumentError(f"data loader state lacks {missing}; got keys {sorted(state)}")
        mine = self.state_dict()
        for key in _FINGERPRINT_KEYS:
            if _plain(state[key]) != mine[key]:
                raise InvalidArgumentError(
                    f"data loader state was saved with {key}={_plain(state[key])!r} but this loader "
                    f"has {key}={mine[key]!r}; resuming would visit other samples. Build the loader "
                    "as in the saved run, or start this epoch afresh without loading its state."
                )
        epoch, consumed = operator.index(state["epoch"]), operator.index(state["consumed"])
        if epoch < 0 or not 0 <= consumed <= self.length:
            raise InvalidArgumentError(
                f"data loader state has epoch={epoch}, consumed={consumed}; need epoch >= 0 and "
                f"0 <= consumed <= {self.length}"
            )
        self._check_global_batch(_plain(state.get("global_batch_size")), consumed)
        self.epoch, self.consumed = epoch, consumed

    def _check_global_batch(self, saved: int | None, consumed: int) -> None:
        """Refuse a saved position that is not a step boundary of this sampler's global batches."""
        mine = self.global_batch_size
        if saved == mine:
            if mine is not None and consumed % mine and consumed != self.length:
                raise InvalidArgumentError(
                    f"data loader state has consumed={consumed}, inside a global batch of {mine}: "
                    "it was not saved between two optimizer steps"
                )
            return
        if saved is not None:
            raise InvalidArgumentError(
                f"data loader state was saved with global_batch_size={saved} but this loader has "
                f"global_batch_size={mine}; resuming would change which samples make each optimizer step. "
                f"Build the loader with global_batch_size={saved}, or start this epoch afresh."
            )
        assert mine is not None
        if consumed % mine and consumed != self.length:
            raise InvalidArgumentError(
                f"data loader state was saved without global_batch_size, {consumed} samples into the epoch, "
                f"which is not a boundary of global batches of {mine}; resume without global_batch_size "
                "until the epoch ends, or start this epoch afresh."
            )
        log.info("data loader state saved without global_batch_size resumes at global batch %d of its epoch",
                 -(-consumed // mine))


def _plain(value: Any) -> Any:
    """A saved scalar as a Python value (a state may come back with 0-d tensors)."""
    return value.item() if isinstance(value, torch.Tensor) else value


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

    **Epochs.** Iterating yields the rest of the current epoch (all of it after a boundary) and,
    once the last batch has been taken and the loop asks for the next one, moves :attr:`epoch` on
    by one. So ``for epoch in range(loader.epoch, n): for batch in loader:`` continues correctly
    after a restore: mid-epoch it yields the rest of that epoch; at a boundary saved right after
    the last batch it yields nothing for that epoch and goes on to the next.

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
    nothing: the next iterator starts with that same batch.

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
            len(dataset), shuffle=shuffle, seed=seed, rank=rank, world_size=world_size,
            drop_last=drop_last, global_batch_size=global_batch_size,
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
        self._reset_pass()
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        """Batches this rank yields in a whole epoch, as for a DataLoader (a resumed pass yields fewer)."""
        per_rank, size = self.sampler.epoch_length(), self.batch_size
        if self._plan.drop_last:
            return per_rank // size
        return -(-per_rank // size)

    def __iter__(self) -> Iterator[Any]:
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
            batch = next(batches)
            self._consume_handed_out()  # asking for this batch means the previous one was used
            self._handed_out = self._plan.size_of(number)
            yield batch
        self._check_current(generation)
        self._consume_handed_out()
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
        self._consume_handed_out()
        if self._step.taken:
            raise UsageError(
                f"a checkpoint was asked for after {self._step.taken} of the {self._step.batches} "
                "micro-batches of an optimizer step: the gradients accumulated so far would be in no "
                "checkpoint. Call ckpt.step() once per optimizer step, after optimizer.step()."
            )
        return self.sampler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at the saved position; see :meth:`ResumableSampler.load_state_dict`."""
        self.sampler.load_state_dict(state)
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


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")


def _check_loader_args(
    dataset: Any, batch_size: int | None, global_batch_size: int | None, micro_batch_size: int | None,
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
            _check_positive(name, value)
    reserved = sorted(_RESERVED_LOADER_ARGS.intersection(extra))
    if reserved:
        raise ArgumentTypeError(f"ResumableLoader sets {reserved} itself; they cannot be passed")
