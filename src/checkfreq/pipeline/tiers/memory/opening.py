"""A rank's memory tier in a job: the tier of its machine's group, and its replica link.

:func:`open_memory_tier` is collective: the ranks learn which of them share a machine's memory
(:func:`checkfreq.ranks.sharing.memory_group`) and, with ``replicas=``, create the group the copies
to other machines travel on (:class:`~checkfreq.pipeline.tiers.memory.replicas.ReplicaLink`).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

from checkfreq.errors import InvalidArgumentError
from checkfreq.pipeline.tiers.memory.replicas import ReplicaLink
from checkfreq.pipeline.tiers.memory.tier import MemoryTier
from checkfreq.policies.memory_cadence import MemoryCadence
from checkfreq.ranks.collectives import GroupPeers, Peers
from checkfreq.ranks.group_share import Group
from checkfreq.ranks.groups import new_gloo_groups
from checkfreq.ranks.sharing import memory_group, memory_key
from checkfreq.storage.format import data_file_name
from checkfreq.storage.shm_listing import remove_regions_beyond

log = logging.getLogger("checkfreq.memory")

REPLICA_GROUP_TIMEOUT = timedelta(days=1)
"""The replica group's gloo timeout, a backstop only: a keeper waits for the next copy as long as the
job runs. A sender that dies closes its connection, which ends the wait at once; one that freezes is
found by its heartbeats within the failure timeout (the link's watch, :class:`ReplicaLink`)."""


def open_memory_tier(
    directory: str | os.PathLike[str],
    cadence: MemoryCadence,
    peers: Peers,
    *,
    replicas: int = 0,
    stride: int = 1,
    failure_timeout: float = 30.0,
) -> MemoryTier:
    """This rank's memory tier for ``directory``, among ``peers`` (the job's ranks); rank 0 first
    removes the regions of ranks this job does not have (an earlier job ran with more). With
    ``replicas``, each snapshot is copied to the shared memory of a rank on each of that many other
    machines, ``stride`` apart in the ring (:mod:`checkfreq.pipeline.tiers.memory.replicas`). Collective."""
    if cadence.every is None and peers.size > 1:  # ranks measuring different costs would snapshot different steps
        raise InvalidArgumentError(
            "under torch.distributed with several ranks, memory= takes a number of steps "
            "(e.g. memory=1), so that every rank snapshots the same steps"
        )
    if peers.rank == 0:
        remove_regions_beyond(directory, peers.size)
    if peers.size == 1:
        if replicas:
            log.warning("memory tier: replicas=%d in a job of one process: no other machine to copy to", replicas)
        return MemoryTier(directory, cadence, data_file=data_file_name(0))
    members = memory_group(peers, memory_key(directory, peers.rank), copies=replicas, stride=stride)
    tier = MemoryTier(
        directory,
        cadence,
        data_file=data_file_name(0),
        rank=peers.rank,
        group=Group(tuple(members.ranks), peers.rank, peers.size),
        failure_timeout=failure_timeout,
        copied=bool(members.sends_to),
    )
    if replicas:  # every rank: the group is created collectively
        _, (copies,) = new_gloo_groups(["replica"], timedelta(seconds=failure_timeout), REPLICA_GROUP_TIMEOUT)
        if len(members.sends_to) < replicas and peers.rank == 0:  # elastic: machines come and go
            log.warning(
                "memory tier: replicas=%d, but the job's machines (replica_stride=%d) give rank 0 %d "
                "other machines to copy to: %d copies are kept",
                replicas,
                stride,
                len(members.sends_to),
                len(members.sends_to),
            )
        tier.link = ReplicaLink(
            copies,
            directory,
            sends_to=members.sends_to,
            receives_from=members.receives_from,
            liveness=peers.liveness if isinstance(peers, GroupPeers) else None,
        )
    return tier
