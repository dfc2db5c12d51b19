"""A rank whose memory snapshots were lost with its node takes them from the copies another rank keeps
(``replicas=``): the restore's first round when a tier keeps copies.

Every rank tells rank 0 the steps of its own snapshots and of the copies its machine keeps, by rank
(a few numbers); rank 0 picks the newest step every rank can have (:func:`~checkfreq.pipeline.restore.plan.fetch_plan`)
and who sends which copy to whom. Each copy goes from its keeper to its rank point to point, over
the control group (bounded by ``failure_timeout``): first a small header (its size and checksum, or
why the keeper cannot read it), then its manifest and data. The receiving rank commits it into its
own region only if it matches the checksum it was kept with; then the restore goes on as if the rank
had never lost it (a replacement node at the same world size resumes from memory).

A copy that cannot be taken over (damaged: it fails its checksum where it is kept, or on arrival)
is passed over and rank 0 plans again: another rank's copy of it if one keeps it, else the newest
older step every rank can have from memory, else the disk checkpoints (local or remote). Each rank
whose copy was passed over logs the snapshot (whose, which step), its keeper (rank and host) and
what the restore does instead.
"""

from __future__ import annotations

import logging
import socket

import torch

from checkfreq.errors import CheckfreqError, PeerLostError
from checkfreq.pipeline.restore.messages import FetchPlan, MemoryReport
from checkfreq.pipeline.restore.plan import fetch_plan, memory_choice
from checkfreq.pipeline.tier import HeldCopy
from checkfreq.pipeline.tiers import Tiers
from checkfreq.ranks.collectives import (
    Peers,
    broadcast_message,
    collect_errors,
    gather_messages,
    receive_json,
    send_json,
)

log = logging.getLogger("checkfreq")


def fetch_copies(tiers: Tiers, peers: Peers, disk: int | None) -> int | None:
    """Bring every rank the newest memory snapshot all can have, from the copies other ranks keep,
    when some rank lost its own; the step brought (None: none needed, or none to be had). Collective.

    ``disk`` is the newest step this rank's disk tiers list: a copy older than disk's is not taken."""
    own, copies = tiers.holdings()
    reports = gather_messages(peers, MemoryReport(own, disk, copies), MemoryReport.from_wire)
    unusable: set[tuple[int, int, int]] = set()  # rank 0: (rank, step, keeper) of each copy found damaged
    damaged = None  # this rank's copy that could not be taken over: logged with what is done instead
    while True:
        plan = broadcast_message(peers, None if reports is None else _plan(reports, unusable), FetchPlan.from_wire)
        if damaged is not None:
            log.warning("memory tier: %s; %s", damaged, plan.instead)
        if plan.step is None:
            return None
        damaged = _take(tiers, peers, plan)
        problems = collect_errors(peers, None if damaged is None else f"rank {peers.rank}: {damaged}")
        if not problems:
            log.info("memory tier: ranks %s took snapshot %d over from the copies other ranks keep",
                     sorted(rank for rank, _ in plan.pairs), plan.step)
            return plan.step
        failed = {(rank, plan.step, keeper) for rank, keeper in plan.pairs
                  if any(p.startswith(f"rank {rank}: ") for p in problems)}
        unusable |= failed or {(rank, plan.step, keeper) for rank, keeper in plan.pairs}  # each round drops one


def _plan(reports: list[MemoryReport], unusable: set[tuple[int, int, int]]) -> FetchPlan:
    """Rank 0's plan, passing over the copies found damaged, and what it does instead of them."""
    plan = fetch_plan(reports, frozenset(unusable))
    if not unusable:
        return plan
    if plan.step is not None:
        plan.instead = f"taking snapshot {plan.step} over from the copies instead (pairs {plan.pairs})"
        return plan
    best = memory_choice(reports).best
    if best is not None:
        plan.instead = f"restoring memory snapshot {best}, which every rank holds, instead"
        return plan
    disk = max((r.disk for r in reports if r.disk is not None), default=None)
    plan.instead = ("no copy left to take: the restore reads the newest checkpoint every rank can read from "
                    "disk (its local directory or the remote tier" + (f"; the newest listed is step {disk})"
                                                                       if disk is not None else "; none is listed)"))
    return plan


def _take(tiers: Tiers, peers: Peers, plan: FetchPlan) -> str | None:
    """Send the copies this rank keeps and take over its own, as ``plan`` says; why this rank's own
    copy could not be taken over (naming the snapshot and its keeper), or None."""
    assert plan.step is not None
    damaged = None
    for rank, keeper in plan.pairs:  # the same order on every rank
        if keeper == peers.rank:
            _send(tiers, peers, rank, plan.step)
        elif rank == peers.rank:
            header = receive_json(peers, keeper)
            try:
                tiers.adopt(_receive(peers, rank, keeper, plan.step, header))
            except PeerLostError:
                raise
            except CheckfreqError as e:  # damaged where it is kept, or on the way
                damaged = (f"rank {rank}'s snapshot {plan.step}: the copy kept by rank {keeper} "
                           f"({header.get('host', 'host unknown')}) cannot be used ({e})")
    return damaged


def _send(tiers: Tiers, peers: Peers, rank: int, step: int) -> None:
    """Send rank ``rank`` the copy of its snapshot ``step`` kept here, or why it cannot be read (the
    receiving rank reports it)."""
    host = socket.gethostname()
    try:
        copy = tiers.read_copy(rank, step)
    except PeerLostError:
        raise
    except CheckfreqError as e:
        send_json(peers, {"error": str(e), "host": host}, rank)
        return
    send_json(peers, {"meta": len(copy.meta), "data": copy.data.numel(), "checksum": copy.checksum,
                      "signature": copy.signature.hex(), "host": host}, rank)
    peers.send(torch.frombuffer(bytearray(copy.meta), dtype=torch.uint8), rank)
    peers.send(copy.data.contiguous(), rank)


def _receive(peers: Peers, rank: int, keeper: int, step: int, header: dict) -> HeldCopy:
    """The copy of this rank's snapshot ``step`` that rank ``keeper`` sends after ``header``."""
    if "error" in header:
        raise CheckfreqError(header["error"])
    meta = peers.receive(int(header["meta"]), keeper).numpy().tobytes()
    data = peers.receive(int(header["data"]), keeper)
    return HeldCopy(rank, step, meta, data, int(header["checksum"]), bytes.fromhex(header["signature"]))
