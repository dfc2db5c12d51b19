"""Which bytes each rank of a group keeps when the group, not each rank, holds the state: the memory
tier on one node (:mod:`checkfreq.pipeline.tiers.memory.tier`).

Under data parallelism every rank holds the replicated state (parameters, optimizer state). The
ranks of one machine keep one copy of it between them in shared memory, each ``1/len(group)`` of
the bytes (cut as :func:`checkfreq.ranks.shares.partition` cuts the disk checkpoint's, over the
group instead of the world), plus its own private tensors whole. A rank that restores reads its
own share and the other shares straight from the group's shared memory: no network.

Sharded state (DTensors: FSDP2's parameters and optimizer state) is each rank's own already: a rank
keeps its local shard, with its place in the global tensor, as a disk checkpoint records it. What
is left replicated beside sharded state (an optimizer's step counters) is small, and each rank
keeps it whole, so that a restore of sharded state reads no other rank's region.

The index a rank stores beside its share (:class:`GroupIndex`) is the ``distributed`` record of a
manifest that :func:`checkfreq.ranks.rebuild.local_view` rebuilds the rank's whole state from, given
the arrays of every share of the group.

Pure functions of names, dtypes, shapes and the group; no communication and no storage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from checkfreq.ranks.rebuild import local_box
from checkfreq.ranks.shares import (
    PRIVATE,
    REPLICATED,
    SHARDED,
    Piece,
    TensorRecord,
    dtype_entry,
    partition,
    piece_view,
    private_name,
)
from checkfreq.run.tensors import is_dtensor, local_part


class GroupIndex(TypedDict):
    """How a rank's state is split over its group: a manifest's ``distributed`` record (JSON as stored)."""

    ranks: list[Any]
    """This rank's skeleton, alone (its private tensors are recorded as saved rank 0's)."""
    tensors: dict[str, TensorRecord]
    """Every tensor's entry: a replicated one's pieces on every rank of the group, in group order;
    a private one's stored name; a sharded one's local shard and its offset."""
    group: list[int]
    """The ranks whose shares make the state up, in group order."""
    world_size: int
    """The job's number of ranks when the shares were taken."""


@dataclass(frozen=True)
class Group:
    """The ranks that hold the state together (one machine's), and this rank's place in the job."""

    ranks: tuple[int, ...]
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if self.rank not in self.ranks:
            raise ValueError(f"rank {self.rank} is not in its group {list(self.ranks)}")


@dataclass(frozen=True)
class _Plan:
    layout: tuple[tuple[str, str, tuple[int, ...]], ...]
    pieces: list[Piece]
    shared: dict[str, TensorRecord]
    beside_sharded: bool
    """Planned for a state with sharded tensors: this rank keeps every replicated tensor whole."""


class GroupSharer:
    """This rank's share of each snapshot of its group (see the module docstring); the split of the
    replicated tensors is planned once per layout."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self._plan: _Plan | None = None

    def select(
        self, tensors: Mapping[str, torch.Tensor], owned: set[str], replicated: set[str], skeleton: Any
    ) -> tuple[dict[str, torch.Tensor], set[str], GroupIndex]:
        """(arrays this rank keeps, which of them are fenced, the index that rebuilds the state).

        ``replicated`` names the tensors that are the same on every rank; every other tensor is this
        rank's own (a DTensor's local shard, any other whole)."""
        sharded = {n for n, t in tensors.items() if is_dtensor(t)}
        names = sorted(n for n in tensors if n in replicated and n not in sharded)
        layout = tuple((n, str(tensors[n].dtype), tuple(tensors[n].shape)) for n in names)
        plan = self._plan
        if plan is None or plan.layout != layout or plan.beside_sharded != bool(sharded):
            ranks = (self.group.rank,) if sharded else self.group.ranks
            replicated_tensors = {n: tensors[n] for n in names}
            plan = self._plan = _plan_for(layout, replicated_tensors, ranks, self.group.rank, bool(sharded))
        arrays = {piece.stored_name: piece_view(tensors[piece.name], piece) for piece in plan.pieces}
        fenced = {piece.stored_name for piece in plan.pieces if piece.name in owned}
        records = dict(plan.shared)
        for name, tensor in tensors.items():
            if name in replicated and name not in sharded:
                continue
            stored = private_name(name, self.group.rank)
            arrays[stored] = local_part(tensor)
            if name in sharded:
                records[name] = _record(tensor, SHARDED, [[stored, list(local_box(tensor)[0])]])
            else:
                records[name] = _record(tensor, PRIVATE, [stored])
            if name in owned:
                fenced.add(stored)
        index = GroupIndex(
            ranks=[skeleton], tensors=records, group=list(self.group.ranks), world_size=self.group.world_size
        )
        return arrays, fenced, index


def _plan_for(
    layout: tuple[tuple[str, str, tuple[int, ...]], ...],
    tensors: Mapping[str, torch.Tensor],
    ranks: tuple[int, ...],
    rank: int,
    beside_sharded: bool,
) -> _Plan:
    """The replicated ``tensors`` cut over ``ranks``: ``rank``'s pieces, and every tensor's record."""
    sizes = [(n, t.numel(), t.element_size()) for n, t in tensors.items()]
    plans = partition(sizes, len(ranks))
    shared: dict[str, TensorRecord] = {}
    for pieces in plans:
        for piece in pieces:
            entry = shared.setdefault(piece.name, _record(tensors[piece.name], REPLICATED, []))
            entry["parts"].append([piece.stored_name, piece.begin, piece.end])
    return _Plan(layout, plans[ranks.index(rank)], shared, beside_sharded)


def _record(tensor: torch.Tensor, kind: str, parts: list[Any]) -> TensorRecord:
    return {"dtype": dtype_entry(tensor), "shape": list(tensor.shape), "kind": kind, "parts": parts}


def replica_ring(groups: Sequence[Sequence[int]], copies: int, stride: int = 1) -> list[tuple[list[int], list[int]]]:
    """Each rank's (ranks it copies its snapshots to, ranks whose snapshots it keeps), given each rank's
    machine (``groups[r]``: the ranks of rank ``r``'s machine, in rank order), ``copies`` (0: none) and
    ``stride``.

    The machines in a ring, by their lowest rank: machine ``i`` copies to machines ``i + stride``,
    ``i + 2 * stride``, ... (mod the number of machines), the first ``copies`` of them that are not
    ``i`` and not already chosen, its ``k``-th rank to each one's ``k``-th (mod its number of ranks).
    Fewer machines than that (one machine: none at all) give fewer copies. One pass per copy."""
    machines = sorted({tuple(g) for g in groups}, key=lambda g: g[0])
    plan: list[tuple[list[int], list[int]]] = [([], []) for _ in groups]
    for i, machine in enumerate(machines):
        for other in replica_machines(i, len(machines), copies, stride):
            for k, rank in enumerate(machine):
                holder = machines[other][k % len(machines[other])]
                plan[rank][0].append(holder)
                plan[holder][1].append(rank)
    return plan


def replica_machines(machine: int, machines: int, copies: int, stride: int) -> list[int]:
    """The machines (by place in the ring of ``machines``) machine ``machine`` copies to: the first
    ``copies`` distinct others of ``machine + stride``, ``machine + 2 * stride``, ... (see :func:`replica_ring`)."""
    chosen: list[int] = []
    for j in range(1, machines):
        other = (machine + j * stride) % machines
        if len(chosen) == copies or other == machine:  # as many as asked, or the ring is walked round
            break
        if other not in chosen:
            chosen.append(other)
    return chosen


def groups_of(keys: Sequence[str]) -> list[list[int]]:
    """Each rank's group: the ranks with its key, in rank order (one pass over the keys)."""
    members: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        members.setdefault(key, []).append(rank)
    return [members[key] for key in keys]
