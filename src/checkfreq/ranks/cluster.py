"""The ranks a Checkpointer checkpoints with, at any world size: one interface, two worlds.

The Checkpointer holds one :class:`Cluster` and never asks whether it runs under
torch.distributed. When a default process group is initialised it is a
:class:`~checkfreq.ranks.group_cluster.GroupCluster` (checkfreq's gloo groups, each rank's share of the
state, decisions agreed by the ranks); in a single process it is a :class:`SoloCluster`, a world
of one whose peers are :class:`~checkfreq.ranks.collectives.Solo` (every collective returns at once):
no process group, no store, and a checkpoint holding the whole state in one file.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from checkfreq.errors import PeerLostError
from checkfreq.policies import DecisionContext, Policy
from checkfreq.ranks.collectives import Peers, Solo
from checkfreq.ranks.group_cluster import GroupCluster, open_directories
from checkfreq.ranks.rebuild import Box, local_view, sharded_blocks
from checkfreq.ranks.shares import Share
from checkfreq.storage.base import Store
from checkfreq.storage.format import Manifest


class Cluster(Protocol):
    """This process's part in checkpointing, seen the same way at every world size."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def control(self) -> Peers:
        """The ranks agreeing, from the training thread, on restores and start-up."""
        ...

    @property
    def commit(self) -> Peers:
        """The ranks committing together, from the writer thread."""
        ...

    @property
    def upload(self) -> Peers | None:
        """The ranks uploading together, from the uploader; None: the uploader uses :attr:`commit`."""
        ...

    @property
    def token(self) -> str:
        """Names this job's staging locations (the same on every rank)."""
        ...

    @property
    def directory_leader(self) -> int:
        """The lowest rank that sees this rank's local directory (it holds the lock and commits)."""
        ...

    @property
    def leader(self) -> bool:
        """This rank is its directory's leader."""
        ...

    @property
    def page_cache(self) -> int | None:
        """Ranks with the same value read their directory through one page cache (see
        :class:`~checkfreq.pipeline.restore.Restorer`)."""
        ...

    @property
    def others_wait(self) -> bool:
        """Other ranks wait on this one: a rank leaving on an error must leave within the failure
        timeout and tell them (:meth:`leave`), rather than finish what it was writing."""
        ...

    @property
    def writes_whole_state(self) -> bool:
        """:meth:`select` keeps every tensor as it is: a snapshot of this rank's whole state is the
        checkpoint's data file, so a memory-tier slot can be persisted as it stands."""
        ...

    @property
    def decide(self) -> Callable[[DecisionContext], bool]:
        """The policy's ``should_save``, answered the same on every rank."""
        ...

    def select(
        self,
        tensors: Mapping[str, torch.Tensor],
        owned: set[str],
        objects: Mapping[str, Any],
        on_device: Callable[[torch.Tensor], bool] = ...,
    ) -> tuple[dict[str, torch.Tensor], set[str], Share | None]:
        """What this rank writes of ``tensors`` (the state of the registered ``objects``): the arrays,
        which of them are fenced (``owned``: optimizer-owned), and the share's index for the commit
        (None: the arrays are the whole state, indexed by the manifest alone). ``on_device``: whether
        a tensor lives on a device, where only the snapshot's copies read it."""
        ...

    def view(
        self, manifest: Manifest, stored: Mapping[str, torch.Tensor], objects: Mapping[str, Any]
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        """This rank's skeleton and tensors of a checkpoint read from storage (``stored``: its data
        files' arrays), written at any world size."""
        ...

    def blocks(self, manifest: Manifest, objects: Mapping[str, Any]) -> dict[str, Box]:
        """The block of each sharded tensor of ``manifest`` that this rank restores into ``objects``
        (what :meth:`view` cuts from the saved shards)."""
        ...

    @property
    def failure(self) -> PeerLostError | None:
        """Why the job failed (a rank was lost, or left on an error), once this rank knows; None in a
        world of one."""
        ...

    def leave(self, error: BaseException, seconds: float) -> None:
        """This rank leaves on ``error``: tell the other ranks, so that none waits for it. If ``error``
        looks like a lost peer's (gloo's closed connection), first watch for at most ``seconds``
        which rank stopped answering, so that the error names it."""
        ...

    def close(self) -> None:
        """Finish what the ranks do together in the background (a vote in flight)."""
        ...

    def release(self) -> None:
        """Give back what the cluster holds, once the writer and the uploader have stopped."""
        ...


def attach(
    local: Store, far: Sequence[Store], timeout: float, policy: Policy, failure_timeout: float = 30.0
) -> Cluster:
    """The cluster this process checkpoints in, its directories opened (``local``, and the ``far``
    stores behind it: the remote tier): the ranks of the default process group if one is initialised
    (collective), else a world of one. ``timeout``: how long storage may take; ``failure_timeout``:
    how long a rank waits for a silent peer."""
    if dist.is_available() and dist.is_initialized():
        return GroupCluster(local, far, timeout, policy, failure_timeout)
    return SoloCluster(local, far, policy)


class SoloCluster:
    """A world of one process: it writes its whole state in one file, decides alone and leads its
    directories (locks them and clears their uncommitted leftovers at start)."""

    rank = 0
    world_size = 1
    upload = None
    directory_leader = 0
    leader = True
    page_cache = None
    others_wait = False
    writes_whole_state = True
    failure = None

    def __init__(self, local: Store, far: Sequence[Store], policy: Policy) -> None:
        self.control = self.commit = Solo()
        self.token = uuid.uuid4().hex[:12]
        self.decide = policy.should_save
        open_directories(local, far, self.control, leader=True)

    def select(
        self,
        tensors: Mapping[str, torch.Tensor],
        owned: set[str],
        objects: Mapping[str, Any],
        on_device: Callable[[torch.Tensor], bool] | None = None,
    ) -> tuple[dict[str, torch.Tensor], set[str], Share | None]:
        return dict(tensors), owned, None

    def view(
        self, manifest: Manifest, stored: Mapping[str, torch.Tensor], objects: Mapping[str, Any]
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        return local_view(manifest, stored)

    def blocks(self, manifest: Manifest, objects: Mapping[str, Any]) -> dict[str, Box]:
        return sharded_blocks(manifest, {})  # no DTensor without a process group: every tensor whole

    def leave(self, error: BaseException, seconds: float) -> None:
        """No other rank waits for this one."""

    def close(self) -> None:
        """Nothing runs in the background between ranks."""

    def release(self) -> None:
        """No group to destroy."""
