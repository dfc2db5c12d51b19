"""One interface for every place a checkpoint lives: the memory tier, the local directory, the remote tier.

A :class:`Tier` has a save side and a restore side, and each hook of the base class does nothing
(a complete null object), so a tier overrides only the hooks that concern it and the Checkpointer
and the restore call every hook of every tier without asking which tier it is:

save side
    :meth:`~Tier.due` (a snapshot of its own is due between persists) and :meth:`~Tier.target`
    (the buffer a snapshot lands in), :meth:`~Tier.submit` (commit such a snapshot),
    :meth:`~Tier.around_persist` (wrap the persist job), :attr:`~Tier.follows_commits`,
    :attr:`~Tier.ready` and :meth:`~Tier.follow` (copy each committed checkpoint), the waits,
    errors and costs it records, :meth:`~Tier.flush` and :meth:`~Tier.close`;
restore side
    :meth:`~Tier.checkpoints` (the committed checkpoints it offers), :meth:`~Tier.read_manifest` and
    :meth:`~Tier.read_data` (one rank's data file of one of them), :meth:`~Tier.snapshots` (whole
    states it holds in memory).

:class:`~checkfreq.pipeline.tiers.Tiers` is the ordered list a Checkpointer holds (fastest first), built by
:func:`checkfreq.pipeline.tiers.choose_tiers`; docs/architecture.md shows a tier of 30 lines.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, TypeVar

import torch

from checkfreq.pipeline.snapshot import PendingSnapshot
from checkfreq.pipeline.writer import Writer
from checkfreq.storage.base import Location, Store
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
    """How the state is split over the ranks that hold it together (:meth:`Tier.share`), if it is."""


@dataclass(frozen=True)
class HeldSnapshot:
    """A snapshot a tier holds and disk may not: persisted at ``close()`` if newer than disk."""

    pending: PendingSnapshot
    skeleton: Any
    step: int
    epoch: int | None


@dataclass(frozen=True)
class HeldState:
    """A verified whole state read back from a tier that holds states (not files)."""

    manifest: Manifest
    tensors: dict[str, torch.Tensor]
    name: str
    """What logs call it (``memory slot 1``)."""
    tier: str
    """The name of the tier holding it."""


@dataclass(frozen=True)
class HeldCopy:
    """A copy of another rank's snapshot a tier keeps (:meth:`Tier.read_copy`), verified, as it lies in
    its slot: what a rank that lost its own takes over (:meth:`Tier.adopt`)."""

    rank: int
    step: int
    meta: bytes
    data: torch.Tensor
    checksum: int
    signature: bytes


class Tier:
    """A place checkpoints live; every hook does nothing (see the module docstring)."""

    name: str = "tier"
    """A :class:`TierName` for checkfreq's tiers."""

    store: Store | None = None
    """The store holding its committed checkpoints, if they are files (the restore reads them there)."""

    follows_commits = False
    """It copies each committed checkpoint (:meth:`follow`): the commit hands it one if every rank's
    copy of this tier is :attr:`ready`."""

    holds_states = False
    """The restore asks it for whole states (:meth:`snapshots`) before files."""

    takes_snapshots = False
    """It takes snapshots of its own between persists (:meth:`due`, :meth:`target`, :meth:`submit`)."""

    # ------------------------------------------------------------------ save side

    @property
    def busy(self) -> bool:
        """A snapshot of its own is still being committed."""
        return False

    def due(self, step: int, iteration_time: float) -> bool:
        """Whether a snapshot into this tier alone is due at ``step``."""
        return False

    def report_to(self, write: Callable[..., None]) -> None:
        """Record what it does in the background with ``write`` (the run's event log)."""

    def share(
        self, tensors: dict[str, torch.Tensor], owned: set[str], objects: Mapping[str, Any], skeleton: Any
    ) -> tuple[dict[str, torch.Tensor], set[str], dict[str, Any] | None]:
        """What it keeps of this rank's state (``tensors``, of the registered ``objects``) for a snapshot
        of its own: (arrays, which are fenced, how the state is split over the ranks that keep it
        together, or None: all of it, here)."""
        return tensors, owned, None

    def target(self, request: SnapshotRequest) -> SnapshotTarget | None:
        """Where the snapshot of ``request`` lands; None: not in this tier."""
        return None

    def submit(self, target: SnapshotTarget, pending: PendingSnapshot, skeleton: Any, epoch: int | None) -> Writer:
        """Commit, in the background, a snapshot taken into ``target`` for this tier alone; return the
        thread that does it (the fence watches it while waiting for the snapshot's deferred copies)."""
        raise NotImplementedError(f"the {self.name} tier takes no snapshots of its own")

    def around_persist(
        self, target: SnapshotTarget | None, pending: PendingSnapshot, persist: Callable[[], T]
    ) -> Callable[[], T]:
        """The persist job, wrapped as this tier needs (``target``: where the snapshot landed)."""
        return persist

    @property
    def ready(self) -> bool:
        """It would copy a checkpoint committed now (no copy in flight)."""
        return True

    def follow(self, step: int) -> None:
        """Copy committed checkpoint ``step`` in the background (every rank follows the same steps)."""

    def flush(self, newest: int | None, timeout: float) -> None:
        """Wait for what is in flight, then copy ``newest`` (the newest committed step) if it was skipped."""

    def stop(self, timeout: float | None = None) -> None:
        """The Checkpointer ends: wait at most ``timeout`` for the copy in flight (its error stays
        for :meth:`take_error`); raise :class:`~checkfreq.errors.PersistTimeoutError` past it."""

    def taken(self, step: int) -> None:
        """The state at ``step`` was snapshot, restored, or counted from."""

    def record_cost(self, seconds: float) -> None:
        """What one of its own snapshots cost the training thread."""

    def record_device_wait(self, seconds: float) -> None:
        """What a training stream waited, on the GPU, for one of its own snapshots' copies."""

    def wait(self, timeout: float) -> BaseException | None:
        """Wait for what runs in the background; return the error of a snapshot of its own, if it failed."""
        return None

    def take_error(self) -> BaseException | None:
        """The error of a background copy (:meth:`follow`, for a tier that :attr:`follows_commits`)
        since the last call, if any."""
        return None

    def describe_error(self, error: BaseException) -> str:
        """How the error of a background copy reads to a user."""
        return f"copying a checkpoint to the {self.name} tier failed: {error}"

    def unpersisted(self, durable_step: int) -> HeldSnapshot | None:
        """The newest snapshot it holds that is newer than ``durable_step`` and can be persisted as it stands."""
        return None

    def close(self, *, remove: bool, timeout: float | None = None) -> None:
        """Stop its threads; with ``remove`` (a clean close) remove what only a restart of this run needs."""

    def release(self) -> None:
        """Give back its lock, once nothing writes to it any more (also after a failure)."""

    # ------------------------------------------------------------------ restore side

    def checkpoints(self) -> Sequence[tuple[int, Location]]:
        """The committed checkpoints it offers, as (step, location) (not verified)."""
        return [] if self.store is None else self.store.checkpoints()

    def read_manifest(self, location: Any) -> Manifest:
        """The manifest of one of :meth:`checkpoints`."""
        assert self.store is not None  # only called with a location it listed
        return self.store.read_manifest(location)

    def read_data(self, location: Any, name: str, size: int, checksum: str) -> tuple[torch.Tensor, dict[str, Any]]:
        """One data file of one of :meth:`checkpoints`, verified: its data section and parsed header."""
        assert self.store is not None  # only called with a location it listed
        return self.store.read_data(location, name, size, checksum)

    def snapshots(
        self, step: int | None = None, *, device_copies: bool = False
    ) -> tuple[list[HeldState], list[tuple[str, str]]]:
        """Every verified state it holds (or those at ``step``), newest first, and the (name, reason)
        of those skipped."""
        return [], []

    keeps_copies = False
    """It keeps copies of other ranks' snapshots (``replicas=``): the restore asks every rank which."""

    def holdings(self) -> tuple[list[int], dict[int, list[int]]]:
        """The steps of the snapshots it holds (not verified), and of the copies it keeps, by rank."""
        return [], {}

    def read_copy(self, rank: int, step: int) -> HeldCopy:
        """Its copy of rank ``rank``'s snapshot ``step``, verified; a :class:`CheckfreqError` if it has none."""
        raise NotImplementedError(f"the {self.name} tier keeps no copies")

    def adopt(self, copy: HeldCopy) -> None:
        """Take ``copy`` (sent by the rank that kept it) as a snapshot of this rank's own."""
        raise NotImplementedError(f"the {self.name} tier keeps no copies")

    def complete(self, state: HeldState) -> HeldState:
        """``state`` (one of :meth:`snapshots`) with what other ranks keep of it added, read where they
        keep it; a :class:`~checkfreq.errors.CheckfreqError` if some of it cannot be read."""
        return state

    def newest_step(self) -> int | None:
        """The step of the newest whole state it holds (:meth:`snapshots`, not verified), if any."""
        return None

    def forget_newer_than(self, step: int) -> None:
        """The run went back to ``step``: what it holds of later steps belongs to an abandoned timeline."""
