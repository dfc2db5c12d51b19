"""What a tier is: a place checkpoints live, and the roles a tier can play.

Every tier is a :class:`Tier` (a name, and an end: :meth:`~Tier.close`, :meth:`~Tier.release`) and
plays one role or more, each an abstract class whose few methods a tier must all define (a
missing or misspelled one fails when the tier is built):

:class:`SnapshotTaker`
    takes snapshots of its own between persists (its cadence: :meth:`~SnapshotTaker.due`), gives
    snapshots a place to land (:meth:`~SnapshotTaker.target`) and wraps the persist that writes
    from it (:meth:`~SnapshotTaker.around_persist`): the memory tier;
:class:`CommitFollower`
    copies each committed checkpoint in the background (:meth:`~CommitFollower.follow`): the
    remote tier;
:class:`CheckpointSource`
    offers committed checkpoints as files in a :class:`~checkfreq.storage.base.Store` to the
    restore: the local directory, the remote tier;
:class:`StateKeeper`
    holds whole states (and copies of other ranks' snapshots) the restore asks for before files:
    the memory tier.

:class:`~checkfreq.pipeline.tiers.chosen.Tiers` is the ordered list a Checkpointer holds (fastest first),
one typed list per role, built by :func:`checkfreq.pipeline.tiers.chosen.choose_tiers`; docs/architecture.md
shows a tier of your own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, TypeVar

import torch

from checkfreq.pipeline.capture.snapshot import PendingSnapshot
from checkfreq.pipeline.capture.writer import Writer
from checkfreq.storage.base import Aside, Location, Store
from checkfreq.storage.format import Layout, Manifest

T = TypeVar("T")


class TierName(str, Enum):
    """The tiers checkfreq has. A name is also what the restore's messages and events call a tier."""

    MEMORY = "memory"
    LOCAL = "local"
    REMOTE = "remote"

    def __str__(self) -> str:
        return self.value


class SnapshotTarget(Protocol):
    """Where a tier has a snapshot land (instead of the snapshotter's private buffer)."""

    @property
    def buffer(self) -> torch.Tensor:
        """``layout.nbytes`` bytes the snapshot is copied into."""
        ...

    @property
    def setup_s(self) -> float:
        """Seconds spent making the target for this snapshot (a one-time cost, not the snapshot's)."""
        ...

    @property
    def views(self) -> list[torch.Tensor] | None:
        """A view of ``buffer`` for each tensor of the snapshot's layout, made ahead (None: none)."""
        ...


@dataclass(frozen=True)
class SnapshotRequest:
    """What a snapshot about to be taken holds, for a tier to make a target for it."""

    layout: Layout
    skeleton: Any
    step: int
    epoch: int | None
    versions: dict[str, str]
    created: float
    device_copies: bool
    """CUDA tensors will be copied in."""
    sharded: bool
    """Some tensors are sharded (DTensors)."""
    split: dict[str, Any] | None = None
    """How the state is split over the ranks that hold it together (:meth:`SnapshotTaker.share`), if it is."""


@dataclass(frozen=True)
class HeldSnapshot:
    """A snapshot a tier holds and disk may not: persisted at ``close()`` if newer than disk."""

    pending: PendingSnapshot
    skeleton: Any
    step: int
    epoch: int | None


@dataclass(frozen=True)
class HeldState:
    """A whole state read back from a tier that holds states (not files), verified once
    :meth:`StateKeeper.complete` returned it."""

    manifest: Manifest
    tensors: dict[str, torch.Tensor]
    name: str
    """What logs call it (``memory slot 1``)."""
    keeper: StateKeeper
    """The tier holding it (which completes it: :meth:`StateKeeper.complete`)."""
    course: int = 0
    """The course of the run it was taken in (:attr:`~checkfreq.storage.shm.SlotInfo.course`)."""

    @property
    def tier(self) -> str:
        """The name of the tier holding it."""
        return str(self.keeper.name)


@dataclass(frozen=True)
class HeldCopy:
    """A copy of another rank's snapshot a tier keeps (:meth:`StateKeeper.read_copy`), verified, as it lies
    in its slot: what a rank that lost its own takes over (:meth:`StateKeeper.adopt`)."""

    rank: int
    step: int
    meta: bytes
    data: torch.Tensor
    checksum: int
    signature: bytes
    course: int = 0
    """The course of the run its snapshot was taken in (:attr:`~checkfreq.storage.shm.SlotInfo.course`)."""


class Tier(ABC):
    """A place checkpoints live: its name, and its end (each role it plays is an abstract class below)."""

    name: str = ""
    """What messages, events and the restore call it (a :class:`TierName` for checkfreq's tiers)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        abstract = any(getattr(getattr(cls, member, None), "__isabstractmethod__", False) for member in dir(cls))
        if not abstract and not cls.name:  # a tier that can be built: a role (abstract) names no tier
            raise TypeError(f"{cls.__name__} must name itself (a class attribute `name`)")

    @abstractmethod
    def close(self, *, remove: bool, timeout: float | None = None) -> None:
        """Stop its threads; with ``remove`` (a clean close) remove what only a restart of this run needs."""

    @abstractmethod
    def release(self) -> None:
        """Give back its lock, once nothing writes to it any more (also after a failure)."""


class SnapshotTaker(Tier):
    """A tier that takes snapshots of its own between persists and gives snapshots a place to land."""

    @property
    @abstractmethod
    def busy(self) -> bool:
        """A snapshot of its own is still being committed."""

    @abstractmethod
    def due(self, step: int, iteration_time: float) -> bool:
        """Whether a snapshot into this tier alone is due at ``step``."""

    @abstractmethod
    def share(
        self, tensors: dict[str, torch.Tensor], owned: set[str], objects: Mapping[str, Any], skeleton: Any
    ) -> tuple[dict[str, torch.Tensor], set[str], dict[str, Any] | None]:
        """What it keeps of this rank's state (``tensors``, of the registered ``objects``) for a snapshot
        of its own: (arrays, which are fenced, how the state is split over the ranks that keep it
        together, or None: all of it, here)."""

    @abstractmethod
    def target(self, request: SnapshotRequest) -> SnapshotTarget | None:
        """Where the snapshot of ``request`` lands; None: not in this tier."""

    @abstractmethod
    def submit(self, target: SnapshotTarget, pending: PendingSnapshot, skeleton: Any, epoch: int | None) -> Writer:
        """Commit, in the background, a snapshot taken into ``target`` for this tier alone; return the
        thread that does it (the fence watches it while waiting for the snapshot's deferred copies)."""

    @abstractmethod
    def around_persist(
        self, target: SnapshotTarget | None, pending: PendingSnapshot, persist: Callable[[], T]
    ) -> Callable[[], T]:
        """The persist job, wrapped as this tier needs (``target``: where the snapshot landed, if here)."""

    @abstractmethod
    def taken(self, step: int) -> None:
        """The state at ``step`` was snapshot, restored, or counted from."""

    @abstractmethod
    def record_cost(self, seconds: float) -> None:
        """What one of its own snapshots cost the training thread."""

    @abstractmethod
    def record_device_wait(self, seconds: float) -> None:
        """What a training stream waited, on the GPU, for one of its own snapshots' copies."""

    @abstractmethod
    def wait(self, timeout: float) -> BaseException | None:
        """Wait for what runs in the background; return the error of a snapshot of its own, if it failed."""

    @abstractmethod
    def unpersisted(self, durable_step: int) -> HeldSnapshot | None:
        """The newest snapshot it holds that is newer than ``durable_step`` and can be persisted as it stands."""

    @abstractmethod
    def report_to(self, write: Callable[..., None]) -> None:
        """Record what it does in the background with ``write`` (the run's event log)."""


class CommitFollower(Tier):
    """A tier that copies each committed checkpoint: the commit hands it one if every rank's copy of it is
    :attr:`ready`."""

    @property
    @abstractmethod
    def ready(self) -> bool:
        """It would copy a checkpoint committed now (no copy in flight)."""

    @abstractmethod
    def follow(self, step: int, source: Store) -> None:
        """Copy checkpoint ``step``, just committed to ``source`` (``source.location(step)``), in the
        background (every rank follows the same steps)."""

    @abstractmethod
    def flush(self, newest: int | None, timeout: float) -> None:
        """Wait for what is in flight, then copy ``newest`` (the newest committed step) if it was skipped."""

    @abstractmethod
    def stop(self, timeout: float | None = None) -> None:
        """The Checkpointer ends: wait at most ``timeout`` for the copy in flight (its error stays
        for :meth:`take_error`); raise :class:`~checkfreq.errors.PersistTimeoutError` past it."""

    @abstractmethod
    def take_error(self) -> BaseException | None:
        """The error of a background copy since the last call, if any."""

    def describe_error(self, error: BaseException) -> str:
        """How the error of a background copy reads to a user."""
        return f"copying a checkpoint to the {self.name} tier failed: {error}"


class CheckpointSource(Tier):
    """A tier whose committed checkpoints are files in a store, read by the restore."""

    @property
    @abstractmethod
    def store(self) -> Store:
        """The store holding its committed checkpoints."""

    def checkpoints(self) -> Sequence[tuple[int, Location]]:
        """The committed checkpoints it offers, as (step, location) (not verified)."""
        return self.store.checkpoints()

    @property
    def tends_listing(self) -> bool:
        """Whether this rank changes what the store lists (sets aside, deletes): in a job of several
        ranks, one rank per store does. A tier of your own runs in a job of one process."""
        return True

    def set_aside_newer_than(self, step: int, reason: str) -> list[int]:
        """The run went on from ``step``: set aside the newer checkpoints listed here (they are of the
        course it left: :attr:`~checkfreq.storage.base.Aside.ABANDONED`) where this rank tends the
        listing, so that no later restore takes one; the steps set aside."""
        if not self.tends_listing:
            return []
        newer = [(s, location) for s, location in self.store.checkpoints() if s > step]
        return [s for s, location in newer if self.store.set_aside(location, reason, Aside.ABANDONED) is not None]

    def read_manifest(self, location: Any) -> Manifest:
        """The manifest of one of :meth:`checkpoints`."""
        return self.store.read_manifest(location)

    def read_data(self, location: Any, name: str, size: int, checksum: str) -> tuple[torch.Tensor, dict[str, Any]]:
        """One data file of one of :meth:`checkpoints`, verified: its data section and parsed header."""
        return self.store.read_data(location, name, size, checksum)


SnapshotKey = tuple[int, int]
"""A held snapshot as the restore names it: its step and its course. A step alone names no state: a
run that went back to an older step and on takes that step's number again for another state."""


class StateKeeper(Tier):
    """A tier that holds whole states, which the restore asks for before files, and may keep copies of
    other ranks' snapshots (``replicas=``)."""

    course: int = 0
    """The course of the run its next snapshots are taken in, the same on every rank (:meth:`Tiers.begin_course`)."""

    @abstractmethod
    def snapshots(
        self, step: int | None = None, *, device_copies: bool = False
    ) -> tuple[list[HeldState], list[tuple[str, str]]]:
        """Every state it holds (or those at ``step``), newest first, its data verified by
        :meth:`complete`, and the (name, reason) of those skipped."""

    @abstractmethod
    def complete(self, state: HeldState) -> HeldState:
        """``state`` (one of :meth:`snapshots`), verified, with what other ranks keep of it added, read
        where they keep it; a :class:`~checkfreq.errors.CheckfreqError` if some of it cannot be read or
        fails its checksum."""

    @abstractmethod
    def newest_step(self) -> int | None:
        """The step of the newest whole state it holds (:meth:`snapshots`, not verified), if any."""

    @abstractmethod
    def forget_newer_than(self, step: int) -> None:
        """The run went back to ``step``: what it holds of later steps belongs to an abandoned timeline."""

    @property
    @abstractmethod
    def keeps_copies(self) -> bool:
        """It keeps copies of other ranks' snapshots: the restore asks every rank which."""

    @abstractmethod
    def holdings(self) -> tuple[list[SnapshotKey], dict[int, list[SnapshotKey]]]:
        """The snapshots it holds (not verified), and the copies it keeps, by rank."""

    @abstractmethod
    def read_copy(self, rank: int, key: SnapshotKey) -> HeldCopy:
        """Its copy of rank ``rank``'s snapshot ``key``, verified; a :class:`CheckfreqError` if it has none."""

    @abstractmethod
    def adopt(self, copy: HeldCopy) -> None:
        """Take ``copy`` (sent by the rank that kept it) as a snapshot of this rank's own."""
