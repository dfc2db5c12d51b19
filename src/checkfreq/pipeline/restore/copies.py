"""A rank whose memory snapshots were lost with its node takes them from the copies another rank keeps
(``replicas=``): the restore's first round when a tier keeps copies.

Every rank tells rank 0 the steps of its own snapshots and of the copies its machine keeps, by rank
(a few numbers; a machine's copies are reported by its first rank only); rank 0 picks the newest
step every rank can have (:func:`~checkfreq.pipeline.restore.plan.fetch_plan`) and, for each rank
that lost it, the keepers of its copy in the order they are tried. Each copy goes from its keeper to
its rank point to point, over the control group (bounded by ``failure_timeout``): first a small
header (a :class:`~checkfreq.pipeline.restore.messages.CopyTransfer`: its sizes and checksum and the
keeper's host; or a :class:`~checkfreq.pipeline.restore.messages.CopyUnreadable`: why the keeper
cannot read it), then its manifest and data. The receiving rank commits it into its own region only
if it matches the checksum it was kept with; then the restore goes on as if the rank had never lost
it (a replacement node at the same world size resumes from memory).

A copy that cannot be taken over (damaged: it fails its checksum where it is kept, or on arrival)
is passed over, and a keeper that could not send one copy goes on sending the others. A rank whose
copy failed tries its next keeper in the next round (every rank learns which ranks still need one
from an elementwise maximum over a flag per such rank). When every keeper of a rank's copy failed,
rank 0 plans again without those copies: the newest older step every rank can have from memory
(its own snapshots or copies), else the disk checkpoints (local or remote). Each failed copy is
logged once, by the rank it belongs to, naming the snapshot (whose, which step), its keeper (rank
and host) and what the restore does instead: the next keeper, an older step, or disk.
"""

from __future__ import annotations

import logging
import socket

import torch

from checkfreq.errors import CheckfreqError, PeerLostError
from checkfreq.pipeline.restore.messages import (
    CopyTransfer,
    CopyUnreadable,
    FetchPlan,
    MemoryReport,
    decode_copy_transfer,
)
from checkfreq.pipeline.restore.plan import fetch_plan, memory_choice
from checkfreq.pipeline.tiers.chosen import Tiers
from checkfreq.pipeline.tiers.roles import HeldCopy, SnapshotKey
from checkfreq.ranks.collectives import (
    Peers,
    broadcast_message,
    gather_messages,
    receive_message,
    send_message,
    tree_max,
)

log = logging.getLogger("checkfreq")


def fetch_copies(tiers: Tiers, peers: Peers, disk: int | None) -> int | None:
    """Bring every rank the newest memory snapshot all can have, from the copies other ranks keep,
    when some rank lost its own; the step brought (None: none needed, or none to be had). Collective.

    ``disk`` is the newest step this rank's disk tiers list: a copy older than disk's is not taken."""
    own, copies = tiers.holdings()
    reports = gather_messages(peers, MemoryReport(own, disk, copies), MemoryReport.from_wire)
    unusable: set[tuple[int, int, int]] = set()  # (rank, step, keeper) of each copy that could not be taken over
    damaged = None  # this rank's copy that no keeper could give: logged with what rank 0 plans instead
    while True:
        plan = broadcast_message(peers, None if reports is None else _plan(reports, unusable), FetchPlan.from_wire)
        if damaged is not None:
            log.warning("memory tier: %s; %s", damaged, plan.instead)
        if plan.step is None:
            return None
        left, damaged = _take(tiers, peers, plan)
        if not left:
            log.info(
                "memory tier: ranks %s took snapshot %d over from the copies other ranks keep",
                sorted({rank for rank, _ in plan.pairs}),
                plan.step,
            )
            return plan.step
        unusable |= {(rank, plan.step, keeper) for rank, keeper in plan.pairs if rank in left}  # at least one more


def _plan(reports: list[MemoryReport], unusable: set[tuple[int, int, int]]) -> FetchPlan:
    """Rank 0's plan, passing over the copies that could not be taken over, and what it does instead."""
    plan = fetch_plan(reports, frozenset(unusable))
    if not unusable:
        return plan
    if plan.step is not None:
        plan.instead = f"taking snapshot {plan.step} over from the copies instead (pairs {plan.pairs})"
        return plan
    best = memory_choice(reports).best
    if best is not None:
        plan.instead = f"restoring memory snapshot {best[0]}, which every rank holds, instead"
        return plan
    disk = max((r.disk for r in reports if r.disk is not None), default=None)
    plan.instead = (
        "no copy left to take: the restore reads the newest checkpoint every rank can read from "
        "disk (its local directory or the remote tier"
        + (f"; the newest listed is step {disk})" if disk is not None else "; none is listed)")
    )
    return plan


def _take(tiers: Tiers, peers: Peers, plan: FetchPlan) -> tuple[set[int], str | None]:
    """Send the copies this rank keeps and take over its own, as ``plan`` says, each rank's keepers
    tried in turn, one round each; the ranks no keeper could give a copy (the same on every rank),
    and why this rank's own last copy tried could not be taken over (None: it was, or none was due)."""
    assert plan.step is not None
    key = (plan.step, plan.course)
    keepers: dict[int, list[int]] = {}
    for rank, keeper in plan.pairs:
        keepers.setdefault(rank, []).append(keeper)
    left, index = list(keepers), {rank: i for i, rank in enumerate(keepers)}
    damaged = None
    for attempt in range(max(len(held) for held in keepers.values())):
        failed = torch.zeros(len(index), dtype=torch.int64)
        for rank in left:  # the same order on every rank
            if attempt >= len(keepers[rank]):
                failed[index[rank]] = 1  # no keeper left to try
                continue
            keeper = keepers[rank][attempt]
            if keeper == peers.rank:
                _send(tiers, peers, rank, key)  # never raises for a copy it cannot read: the next one is sent
            elif rank == peers.rank:
                damaged = _take_one(tiers, peers, rank, keeper, key)
                if damaged is not None:
                    failed[index[rank]] = 1
                    if attempt + 1 < len(keepers[rank]):  # logged now; the last one with rank 0's next plan
                        log.warning(
                            "memory tier: %s; trying the copy rank %d keeps", damaged, keepers[rank][attempt + 1]
                        )
                        damaged = None
        failed = tree_max(peers, failed)
        left = [rank for rank in left if failed[index[rank]]]
        if not left:
            break
    return set(left), damaged


def _take_one(tiers: Tiers, peers: Peers, rank: int, keeper: int, key: SnapshotKey) -> str | None:
    """Take over this rank's copy of snapshot ``key`` from rank ``keeper``; why it cannot be used
    (naming the snapshot and its keeper), or None."""
    header = receive_message(peers, keeper, decode_copy_transfer)
    step = key[0]
    try:
        tiers.adopt(_receive(peers, rank, keeper, key, header))
    except PeerLostError:
        raise
    except CheckfreqError as e:  # damaged where it is kept, or on the way
        return f"rank {rank}'s snapshot {step}: the copy kept by rank {keeper} ({header.host}) cannot be used ({e})"
    return None


def _send(tiers: Tiers, peers: Peers, rank: int, key: SnapshotKey) -> None:
    """Send rank ``rank`` the copy of its snapshot ``key`` kept here, or why it cannot be read (the
    receiving rank reports it)."""
    host = socket.gethostname()
    try:
        copy = tiers.read_copy(rank, key)
    except PeerLostError:
        raise
    except CheckfreqError as e:
        send_message(peers, CopyUnreadable(str(e), host), rank)
        return
    send_message(peers, CopyTransfer(len(copy.meta), copy.data.numel(), copy.checksum, copy.signature, host), rank)
    peers.send(torch.frombuffer(bytearray(copy.meta), dtype=torch.uint8), rank)
    peers.send(copy.data.contiguous(), rank)


def _receive(peers: Peers, rank: int, keeper: int, key: SnapshotKey, header: CopyTransfer | CopyUnreadable) -> HeldCopy:
    """The copy of this rank's snapshot ``key`` that rank ``keeper`` sends after ``header``."""
    if isinstance(header, CopyUnreadable):
        raise CheckfreqError(header.error)
    meta = peers.receive(header.meta, keeper).numpy().tobytes()
    data = peers.receive(header.data, keeper)
    return HeldCopy(rank, key[0], meta, data, header.checksum, header.signature, key[1])
