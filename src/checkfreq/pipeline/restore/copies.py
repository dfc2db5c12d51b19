"""A rank whose memory snapshots were lost with its node takes them from the copies another rank keeps
(``replicas=``): the restore's first round when a tier keeps copies.

Every rank tells rank 0 the steps of its own snapshots and of the copies its machine keeps, by rank
(a few numbers); rank 0 picks the newest step every rank can have (:func:`~checkfreq.pipeline.restore.plan.fetch_plan`)
and, for each rank that lost it, the keepers of its copy in the order they are tried. Each copy goes
from its keeper to its rank point to point, over the control group (bounded by ``failure_timeout``):
first a small header (its size and checksum, or why the keeper cannot read it), then its manifest
and data. The receiving rank commits it into its own region only if it matches the checksum it was
kept with. A rank whose copy could not be taken over tries its next keeper in the next round (every
rank learns which ranks need one from an elementwise maximum over a flag per such rank); then the
restore goes on as if the rank had never lost it (a replacement node at the same world size
resumes from memory).
"""

from __future__ import annotations

import logging

import torch

from checkfreq.errors import CheckfreqError
from checkfreq.pipeline.restore.messages import FetchPlan, MemoryReport
from checkfreq.pipeline.restore.plan import fetch_plan
from checkfreq.pipeline.tier import HeldCopy
from checkfreq.pipeline.tiers import Tiers
from checkfreq.ranks.collectives import (
    Peers,
    broadcast_message,
    collect_errors,
    gather_messages,
    receive_json,
    send_json,
    tree_max,
)

log = logging.getLogger("checkfreq")


def fetch_copies(tiers: Tiers, peers: Peers, disk: int | None) -> int | None:
    """Bring every rank the newest memory snapshot all can have, from the copies other ranks keep,
    when some rank lost its own; the step brought (None: none needed, or none to be had). Collective.

    ``disk`` is the newest step this rank's disk tiers list: a copy older than disk's is not taken."""
    own, copies = tiers.holdings()
    reports = gather_messages(peers, MemoryReport(own, disk, copies), MemoryReport.from_wire)
    plan = broadcast_message(peers, None if reports is None else fetch_plan(reports), FetchPlan.from_wire)
    if plan.step is None:
        return None
    keepers: dict[int, list[int]] = {}
    for rank, keeper in plan.pairs:
        keepers.setdefault(rank, []).append(keeper)
    left, index = list(keepers), {rank: i for i, rank in enumerate(keepers)}
    problem = None
    for attempt in range(max(len(held) for held in keepers.values())):
        failed = torch.zeros(len(index), dtype=torch.int64)
        for rank in left:  # the same order on every rank
            if attempt >= len(keepers[rank]):
                failed[index[rank]] = 1  # no keeper left to try
                continue
            keeper = keepers[rank][attempt]
            try:
                if keeper == peers.rank:
                    _send(tiers, peers, rank, plan.step)
                elif rank == peers.rank:
                    tiers.adopt(_receive(peers, rank, keeper, plan.step))
            except CheckfreqError as e:
                failed[index[rank]] = 1
                problem = f"rank {peers.rank}: {e}"
                if rank == peers.rank and attempt + 1 < len(keepers[rank]):
                    log.warning("memory tier: %s; trying the copy rank %d keeps", e, keepers[rank][attempt + 1])
        failed = tree_max(peers, failed)
        left = [rank for rank in left if failed[index[rank]]]
        if not left:
            problem = None
            break
    problems = collect_errors(peers, problem)
    if problems:
        log.warning("memory tier: the copies of snapshot %d could not be taken over (%s)", plan.step,
                    "; ".join(problems))
        return None
    log.info("memory tier: ranks %s took snapshot %d over from the copies other ranks keep", sorted(keepers),
             plan.step)
    return plan.step


def _send(tiers: Tiers, peers: Peers, rank: int, step: int) -> None:
    """Send rank ``rank`` the copy of its snapshot ``step`` kept here, or why it cannot be read."""
    try:
        copy = tiers.read_copy(rank, step)
    except CheckfreqError as e:
        send_json(peers, {"error": str(e)}, rank)
        raise
    send_json(peers, {"meta": len(copy.meta), "data": copy.data.numel(), "checksum": copy.checksum,
                      "signature": copy.signature.hex()}, rank)
    peers.send(torch.frombuffer(bytearray(copy.meta), dtype=torch.uint8), rank)
    peers.send(copy.data.contiguous(), rank)


def _receive(peers: Peers, rank: int, keeper: int, step: int) -> HeldCopy:
    """The copy of this rank's snapshot ``step`` that rank ``keeper`` sends."""
    header = receive_json(peers, keeper)
    if "error" in header:
        raise CheckfreqError(f"rank {keeper} cannot send its copy of memory snapshot {step}: {header['error']}")
    meta = peers.receive(int(header["meta"]), keeper).numpy().tobytes()
    data = peers.receive(int(header["data"]), keeper)
    return HeldCopy(rank, step, meta, data, int(header["checksum"]), bytes.fromhex(header["signature"]))
