"""The tiers a Checkpointer holds, in order, fastest first: which ones it has (:func:`choose_tiers`,
the one place they are chosen), and each question put to the tiers that play the role it concerns.

The first :class:`~checkfreq.pipeline.tiers.roles.CheckpointSource` (the local directory) is where
checkpoints are committed; the sources after it (the remote tier) are the *far* tiers the restore
reads what no directory holds from.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from checkfreq.errors import CheckfreqError, InvalidArgumentError
from checkfreq.pipeline.capture.snapshot import PendingSnapshot
from checkfreq.pipeline.retention.retainer import Retainer
from checkfreq.pipeline.tiers.local import LocalTier
from checkfreq.pipeline.tiers.memory.opening import open_memory_tier
from checkfreq.pipeline.tiers.remote import RemoteTier
from checkfreq.pipeline.tiers.roles import (
    CheckpointSource,
    CommitFollower,
    HeldCopy,
    HeldSnapshot,
    HeldState,
    SnapshotKey,
    SnapshotRequest,
    SnapshotTaker,
    SnapshotTarget,
    StateKeeper,
    Tier,
)
from checkfreq.policies.memory_cadence import MemoryCadence
from checkfreq.policies.retention import Retention
from checkfreq.ranks.cluster import Cluster
from checkfreq.storage.base import Store
from checkfreq.storage.local import LocalStore

T = TypeVar("T")

log = logging.getLogger("checkfreq.tiers")


@dataclass(frozen=True)
class Placement:
    """Where a snapshot lands: a tier's target."""

    tier: SnapshotTaker
    target: SnapshotTarget


class Tiers:
    """An ordered list of tiers, fastest first, with at least one checkpoint source, and one list per
    role (see the module docstring)."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        self.all = list(tiers)
        self.takers = [tier for tier in self.all if isinstance(tier, SnapshotTaker)]
        """The tiers that take snapshots of their own and give snapshots a place to land."""
        self.followers = [tier for tier in self.all if isinstance(tier, CommitFollower)]
        """The tiers that copy each committed checkpoint."""
        self.keepers = [tier for tier in self.all if isinstance(tier, StateKeeper)]
        """The tiers that hold whole states for the restore."""
        sources = [tier for tier in self.all if isinstance(tier, CheckpointSource)]
        if not sources:
            raise ValueError("a Checkpointer's tiers need one with a store, where checkpoints are committed")
        self.committed_to = sources[0]
        """Where the commit protocol writes every checkpoint."""
        self.far = sources[1:]
        """The checkpoint sources behind it."""
        self.stores = [tier.store for tier in sources]
        """The stores of the checkpoint sources: where checkpoints are committed first, then the far ones."""
        self._went_back_to: int | None = None
        """The step the run restored, until it goes on from it (:meth:`going_on`)."""

    @property
    def store(self) -> Store:
        """The store checkpoints are committed to."""
        return self.stores[0]

    def where(self) -> str:
        """The stores' roots, as an error names where it looked."""
        return " or ".join(str(store.root) for store in self.stores)

    def searched(self) -> list[str]:
        """The tiers a restore looks in, as messages name them (``memory tier``, ``local tier (/path)``)."""
        keepers = [f"{tier.name} tier" for tier in self.keepers]
        return keepers + [f"{tier.name} tier ({tier.store.root})" for tier in [self.committed_to, *self.far]]

    @property
    def busy(self) -> bool:
        """A snapshot taken for a tier alone is still being committed."""
        return any(tier.busy for tier in self.takers)

    @property
    def holds_states(self) -> bool:
        """A tier holds whole states, which the restore asks for before files."""
        return bool(self.keepers)

    def due(self, step: int, iteration_time: float) -> list[SnapshotTaker]:
        """The tiers a snapshot of their own is due in at ``step`` (asked at every step)."""
        return [tier for tier in self.takers if tier.due(step, iteration_time)]

    def place(self, request: SnapshotRequest) -> Placement | None:
        """The first tier that gives the snapshot a target; None: the snapshotter's own buffer."""
        for tier in self.takers:
            target = tier.target(request)
            if target is not None:
                return Placement(tier, target)
        return None

    def around_persist(
        self, placement: Placement | None, pending: PendingSnapshot, persist: Callable[[], T]
    ) -> Callable[[], T]:
        """The persist job wrapped by every tier, the fastest outermost (each told the target if it is its own)."""
        for tier in reversed(self.takers):
            own = placement.target if placement is not None and placement.tier is tier else None
            persist = tier.around_persist(own, pending, persist)
        return persist

    def taken(self, step: int) -> None:
        for tier in self.takers:
            tier.taken(step)

    def record_device_wait(self, seconds: float) -> None:
        for tier in self.takers:
            tier.record_device_wait(seconds)

    def wait(self, timeout: float) -> tuple[SnapshotTaker, BaseException] | None:
        """Wait for every tier's own snapshot in flight; the first that failed, with its error."""
        errors = [(tier, tier.wait(timeout)) for tier in self.takers]
        return next(((tier, e) for tier, e in errors if e is not None), None)

    def take_errors(self) -> list[tuple[CommitFollower, BaseException]]:
        """Each follower's background copy that failed since the last call (asked at every step)."""
        return [(tier, error) for tier in self.followers if (error := tier.take_error()) is not None]

    def flush(self, newest: int | None, timeout: float) -> None:
        for tier in self.followers:
            tier.flush(newest, timeout)

    def stop(self, timeout: float | None) -> None:
        for tier in self.followers:
            tier.stop(timeout)

    def unpersisted(self, durable_step: int) -> HeldSnapshot | None:
        """The newest state a tier holds that disk does not (newer than ``durable_step``)."""
        held = [s for s in (tier.unpersisted(durable_step) for tier in self.takers) if s is not None]
        return max(held, key=lambda s: s.step, default=None)

    def close(self, *, remove: bool, timeout: float | None = None) -> None:
        for tier in self.all:
            tier.close(remove=remove, timeout=timeout)

    def release(self) -> None:
        for tier in self.all:
            tier.release()

    def snapshots(self, step: int | None, *, device_copies: bool) -> tuple[list[HeldState], list[tuple[str, str]]]:
        """Every tier's verified whole states (or those at ``step``), newest first, and those skipped."""
        states: list[HeldState] = []
        skipped: list[tuple[str, str]] = []
        for tier in self.keepers:
            found, passed = tier.snapshots(step, device_copies=device_copies)
            states += found
            skipped += passed
        return sorted(states, key=lambda s: -s.manifest.step), skipped

    @property
    def keeps_copies(self) -> bool:
        """A tier keeps copies of other ranks' snapshots (``replicas=``)."""
        return any(tier.keeps_copies for tier in self.keepers)

    def begin_course(self, course: int) -> None:
        """The snapshots taken from now on are of ``course`` (every rank's the same): a step they share
        with an older snapshot names another state unless the courses match too."""
        for tier in self.keepers:
            tier.course = course

    def holdings(self) -> tuple[list[SnapshotKey], dict[int, list[SnapshotKey]]]:
        """The snapshots the tiers hold, and the copies they keep, by rank (not verified)."""
        own: set[SnapshotKey] = set()
        copies: dict[int, set[SnapshotKey]] = {}
        for tier in self.keepers:
            steps, kept = tier.holdings()
            own.update(steps)
            for rank, held in kept.items():
                copies.setdefault(rank, set()).update(held)
        return sorted(own), {rank: sorted(held) for rank, held in copies.items()}

    def read_copy(self, rank: int, key: SnapshotKey) -> HeldCopy:
        """The copy of rank ``rank``'s snapshot ``key`` the first tier keeping one holds, verified."""
        errors = []
        for tier in self.keepers:
            if tier.keeps_copies:
                try:
                    return tier.read_copy(rank, key)
                except CheckfreqError as e:
                    errors.append(str(e))
        raise CheckfreqError("; ".join(errors) or f"no tier keeps copies of rank {rank}'s snapshots")

    def adopt(self, copy: HeldCopy) -> None:
        """Take a copy another rank kept of this rank's snapshot as this rank's own, in the fastest tier
        keeping copies (where its own would have been)."""
        keeper = next((tier for tier in self.keepers if tier.keeps_copies), None)
        if keeper is None:
            raise CheckfreqError(f"no tier keeps copies: the copy of step {copy.step} cannot be adopted")
        keeper.adopt(copy)

    def newest_step(self) -> int | None:
        """The newest whole state any tier holds (not verified)."""
        return max((s for s in (tier.newest_step() for tier in self.keepers) if s is not None), default=None)

    def went_back_to(self, step: int) -> None:
        """The run restored ``step``: the tiers that hold states drop what they hold of later steps, and
        the newer checkpoints the sources list are set aside once the run goes on (:meth:`going_on`)."""
        for tier in self.keepers:
            tier.forget_newer_than(step)
        self._went_back_to = step

    def going_on(self) -> None:
        """The run trains on (a ``step()``, ``save()`` or ``log()``): if it restored a step, the sources
        set aside the checkpoints newer than it, of the course the run left, which no later restore may
        take (a restore only to look at an older state, with no training after it, leaves them)."""
        step, self._went_back_to = self._went_back_to, None
        if step is None:
            return
        reason = f"the run went on from step {step} at {time.strftime('%Y-%m-%d %H:%M:%S')}"
        for source in [self.committed_to, *self.far]:
            if newer := source.set_aside_newer_than(step, reason):
                log.warning(
                    "going on from step %d: the newer checkpoints of %s (steps %s) are of the course the run "
                    "left; set aside (step_N.abandoned-<id>, or a damaged.json in an object store), no restore "
                    "takes them, and retention deletes them once keep= newer checkpoints exist",
                    step,
                    source.store.root,
                    ", ".join(map(str, sorted(newer))),
                )


def choose_tiers(
    local: Store,
    far: Sequence[Store],
    cluster: Cluster,
    *,
    memory: MemoryCadence | None,
    retainer: Retainer,
    far_retention: Retention,
    replicas: int = 0,
    replica_stride: int = 1,
    failure_timeout: float = 30.0,
    own: Sequence[Tier] = (),
) -> Tiers:
    """A Checkpointer's tiers: the memory tier (with ``memory``, its snapshots copied to ``replicas``
    other machines, ``replica_stride`` apart in the ring of machines), its directory, the remote tier
    (``far``), then the user's ``own`` (``tiers=``, in a job of one process).

    The one place tiers are chosen: a new tier of checkfreq's is a module of its own and a line here.
    """
    check_own_tiers(own, cluster.world_size)
    chosen: list[Tier] = []
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise InvalidArgumentError(f"replicas must be an int >= 0 (copies on other machines), got {replicas!r}")
    if isinstance(replica_stride, bool) or not isinstance(replica_stride, int) or replica_stride < 1:
        raise InvalidArgumentError(
            f"replica_stride must be an int >= 1 (machine i copies to machine "
            f"i + replica_stride, then i + 2 * replica_stride, ...), got {replica_stride!r}"
        )
    if replicas and memory is None:
        raise InvalidArgumentError("replicas= copies memory snapshots to another machine: it needs memory= too")
    if memory is not None:
        chosen.append(
            open_memory_tier(
                local.root,
                memory,
                cluster.control,
                replicas=replicas,
                stride=replica_stride,
                failure_timeout=failure_timeout,
            )
        )
    chosen.append(LocalTier(local, leader=cluster.leader))
    for store in far:
        assert isinstance(local, LocalStore)  # open_stores puts a local directory in front of a remote tier
        chosen.append(
            RemoteTier(
                local,
                store,
                cluster.commit if cluster.upload is None else cluster.upload,
                token=cluster.token,
                retention=far_retention,
                local_retainer=retainer,
            )
        )
    return Tiers([*chosen, *own])


def check_own_tiers(own: Sequence[Tier], world_size: int) -> None:
    """Refuse what ``tiers=`` cannot take: objects that are not tiers, and any under several ranks."""
    for tier in own:
        if not isinstance(tier, Tier):
            raise InvalidArgumentError(
                f"tiers= takes Tier objects (checkfreq.pipeline.tiers.roles: a CommitFollower, a "
                f"CheckpointSource, ...), "
                f"got {type(tier).__name__}"
            )
    if own and world_size > 1:
        raise InvalidArgumentError(
            f"tiers= runs in a job of one process; this job has {world_size} ranks, and a tier of your own "
            "does not know which rank writes which file of a checkpoint (docs/architecture.md, "
            "'A tier of your own')"
        )
