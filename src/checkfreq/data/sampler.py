"""``ResumableSampler``: this rank's sample indices of an epoch, from the first not yet consumed."""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import Sampler

from checkfreq.data.order import (
    FINGERPRINT_KEYS,
    ORDER_DOMAIN,
    check_positive,
    check_topology,
    job_topology,
    mix,
    plain,
)
from checkfreq.errors import InvalidArgumentError, TopologyError, UsageError

log = logging.getLogger("checkfreq.data")


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
            check_positive("global_batch_size", global_batch_size)
        self.length = length
        self.shuffle = shuffle
        self.seed = seed
        self._given = (rank, world_size)
        if rank is not None and world_size is not None:
            check_topology(rank, world_size)
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
        return self._fill(job_topology() or (0, 1))

    def _fill(self, job: tuple[int, int]) -> tuple[int, int]:
        """The given rank and world size, the job's where not given."""
        rank, world_size = self._given
        return check_topology(job[0] if rank is None else rank, job[1] if world_size is None else world_size)

    def bind(self) -> tuple[int, int]:
        """Fix the topology at the start of a pass; raise if the job's no longer matches the one fixed.

        Raises:
            TopologyError: the first pass ran with another rank or world size than the job has now
                (typically: it ran before ``init_process_group``).
        """
        if self._bound is None:
            self._bound = self.topology()
            return self._bound
        job = job_topology()
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
        generator = torch.Generator().manual_seed(mix(ORDER_DOMAIN, self.seed, epoch))
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
        ``set_epoch(epoch)`` at the top of each epoch safe after a restore (start the epoch loop
        at the loader's ``epoch``). Moving back to an earlier epoch trains its samples again, and
        logs a warning saying so.
        """
        if epoch < 0:
            raise InvalidArgumentError(f"epoch must be >= 0, got {epoch}")
        if epoch < self.epoch:
            log.warning(
                "set_epoch(%d) moves the data position back from epoch %d to the start of epoch %d: its samples "
                "are taken again. After a restore, start the epoch loop at the loader's epoch "
                "(for epoch in range(loader.epoch, epochs)).",
                epoch,
                self.epoch,
                epoch,
            )
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
        missing = [k for k in ("epoch", "consumed", *FINGERPRINT_KEYS) if k not in state]
        if missing:
            raise InvalidArgumentError(f"data loader state lacks {missing}; got keys {sorted(state)}")
        mine = self.state_dict()
        for key in FINGERPRINT_KEYS:
            if plain(state[key]) != mine[key]:
                raise InvalidArgumentError(
                    f"data loader state was saved with {key}={plain(state[key])!r} but this loader "
                    f"has {key}={mine[key]!r}; resuming would visit other samples. Build the loader "
                    "as in the saved run, or start this epoch afresh without loading its state."
                )
        epoch, consumed = operator.index(state["epoch"]), operator.index(state["consumed"])
        if epoch < 0 or not 0 <= consumed <= self.length:
            raise InvalidArgumentError(
                f"data loader state has epoch={epoch}, consumed={consumed}; need epoch >= 0 and "
                f"0 <= consumed <= {self.length}"
            )
        self._check_global_batch(plain(state.get("global_batch_size")), consumed)
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
        log.info(
            "data loader state saved without global_batch_size resumes at global batch %d of its epoch",
            -(-consumed // mine),
        )
