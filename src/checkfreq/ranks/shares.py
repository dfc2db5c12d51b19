"""Which bytes each rank writes (:mod:`checkfreq.ranks.rebuild`: how a rank rebuilds its state from them).

Pure functions of names, dtypes, shapes and placements; no communication and no storage.

Three kinds of tensors, by where they come from:

* **replicated** (data parallel: every rank holds the same values, and checkfreq verifies it, see
  :mod:`checkfreq.ranks.replicas`): the parameters of registered modules and optimizers and the
  optimizer state. The tensors are laid end to end, in name order, as one byte stream, and the
  stream is cut into ``world_size`` ranges of nearly equal size. A tensor that straddles a cut is
  split into ranges of its flattened elements (unless it is small, then the cut moves to its
  nearer edge), so every rank writes about ``1/world_size`` of the bytes;
* **private** (everything else: buffers such as BatchNorm statistics, plain values, random
  generators, other objects' tensors; they may differ between ranks): each rank writes its own
  copy and gets it back;
* **sharded** (DTensor, e.g. FSDP2 parameters and optimizer state): each rank writes its local
  shard with its place in the global tensor (offset and shape), so any other layout can be cut
  from the saved shards on restore.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from checkfreq.ranks.replicas import ReplicaClaim
from checkfreq.run.tensors import is_dtensor
from checkfreq.storage.format import (
    DTYPE_CODES,
)

log = logging.getLogger("checkfreq")


class _TensorRecord(TypedDict):
    dtype: str
    """The safetensors dtype code."""
    shape: list[int]
    """The global shape."""
    kind: str
    """:data:`REPLICATED`, :data:`PRIVATE` or :data:`SHARDED`."""
    parts: list[Any]
    """Where its values are stored: a replicated tensor's ``[stored name, begin, end]`` pieces, in rank
    order; a private tensor's stored name per rank (None: that rank holds none); a sharded tensor's
    ``[stored name, offset]`` shards (in a rank's record: its own)."""


class TensorRecord(_TensorRecord, total=False):
    """How one tensor is split over the ranks: an entry of the manifest's ``distributed["tensors"]``
    and of a rank's record in its data file's header (the JSON as stored; see the module docstring)."""

    chunked: int
    """A sharded tensor cut along this dimension as ``torch.chunk`` cuts it, block ``k`` on rank ``k``."""


class Share(TypedDict):
    """What a rank writes of a snapshot under torch.distributed, for the commit: ``GroupCluster.select``."""

    rank: dict[str, TensorRecord]
    """This rank's own tensors' entries (private tensors, local shards): in its data file's header."""
    shared: dict[str, TensorRecord]
    """The entries every rank records the same (replicated and sharded tensors): in the manifest."""
    replicas: ReplicaClaim
    """This rank's claim of the replicated state (``replicas.report``)."""
    plan: str | None
    """The digest of the plan that split the replicated state (None: no replicated state)."""
    later: dict[str, torch.Tensor]
    """The pieces of the claim on a device, by label: the snapshot copies them to the host with the
    state, and the writer completes ``replicas`` with their fingerprints (``replicas.resolve``)."""


REPLICATED, PRIVATE, SHARDED = "replicated", "private", "sharded"
SMALL_FRACTION = 16
"""A tensor smaller than 1/16 of a rank's share is never split: the cut moves to its nearer edge."""


@dataclass(frozen=True)
class Piece:
    """Elements ``[begin, end)`` of the flattened replicated tensor ``name``."""

    name: str
    begin: int
    end: int
    whole: bool

    @property
    def stored_name(self) -> str:
        """The piece's name in its data file."""
        return self.name if self.whole else f"{self.name}@{self.begin}-{self.end}"


def kind_of(name: str, tensor: torch.Tensor, replicated: Container[str]) -> str:
    """Whether ``name`` is sharded (a DTensor), replicated (named in ``replicated``) or private."""
    if is_dtensor(tensor):
        return SHARDED
    return REPLICATED if name in replicated else PRIVATE


def private_name(name: str, rank: int) -> str:
    """The stored name of a rank's own copy (private tensor or local shard)."""
    return f"{name}@rank{rank:05d}"


def partition(sizes: Sequence[tuple[str, int, int]], world_size: int) -> list[list[Piece]]:
    """Split replicated tensors ``(name, numel, itemsize)`` over ``world_size`` ranks by bytes.

    Returns each rank's pieces. Deterministic: every rank computes the same plan from the same
    (sorted) input. Each rank's share differs from ``total / world_size`` by less than
    ``total / world_size / SMALL_FRACTION`` bytes plus one element and one byte (the ideal cuts
    are rounded down to a byte, then to the nearer element boundary).
    """
    items = sorted(s for s in sizes if s[1] > 0)
    empty = [Piece(name, 0, 0, True) for name, numel, _ in sorted(sizes) if numel == 0]
    starts, _ = _starts(items)
    bounds = cuts(sizes, world_size)
    plans = [_pieces_between(items, starts, lo, hi) for lo, hi in itertools.pairwise(bounds)]
    plans[0][:0] = empty  # nothing to balance; rank 0 records them
    return plans


def cuts(sizes: Sequence[tuple[str, int, int]], world_size: int) -> list[int]:
    """Where :func:`partition` cuts the replicated byte stream: rank ``k`` writes bytes
    ``[cuts[k], cuts[k + 1])`` of the tensors laid end to end in name order. O(N log T)."""
    items = sorted(s for s in sizes if s[1] > 0)
    starts, total = _starts(items)
    bounds = [0]
    for k in range(1, world_size):
        bounds.append(max(bounds[-1], _cut(items, starts, total * k // world_size, total // world_size)))
    bounds.append(total)
    return bounds


def stream_range(sizes: Sequence[tuple[str, int, int]], begin: int, end: int) -> list[Piece]:
    """The pieces covering bytes ``[begin, end)`` of the replicated tensors laid end to end in name order.

    Cut at element boundaries: an element straddling ``end`` belongs to the next range.
    """
    items = sorted(s for s in sizes if s[1] > 0)
    starts, _ = _starts(items)
    return _pieces_between(items, starts, begin, end)


def _starts(items: Sequence[tuple[str, int, int]]) -> tuple[list[int], int]:
    """Each tensor's first byte in the stream, and the stream's length."""
    starts, offset = [], 0
    for _, numel, itemsize in items:
        starts.append(offset)
        offset += numel * itemsize
    return starts, offset


def _cut(items: Sequence[tuple[str, int, int]], starts: Sequence[int], ideal: int, share: int) -> int:
    """Where the byte stream is cut near ``ideal``: at an element boundary, or a small tensor's edge.

    O(log T): the tensor holding byte ``ideal`` is found by bisection.
    """
    i = bisect.bisect_right(starts, ideal) - 1
    if i < 0:
        return ideal
    _, numel, itemsize = items[i]
    start = starts[i]
    end = start + numel * itemsize
    if ideal >= end:
        return ideal
    if end - start < max(share // SMALL_FRACTION, 1):
        return start if ideal - start <= end - ideal else end
    return start + round((ideal - start) / itemsize) * itemsize


def _pieces_between(items: Sequence[tuple[str, int, int]], starts: Sequence[int], lo: int, hi: int) -> list[Piece]:
    """The pieces covering bytes ``[lo, hi)``, from the tensor holding byte ``lo`` (found by bisection) on."""
    pieces = []
    for i in range(max(bisect.bisect_right(starts, lo) - 1, 0), len(items)):
        (name, numel, itemsize), start = items[i], starts[i]
        if start >= hi:
            break
        a, b = max(lo, start), min(hi, start + numel * itemsize)
        if a < b:
            begin, stop = (a - start) // itemsize, (b - start) // itemsize
            pieces.append(Piece(name, begin, stop, begin == 0 and stop == numel))
    return pieces


def piece_view(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The live values a piece covers (a view when ``tensor`` is contiguous)."""
    return tensor if piece.whole else tensor.reshape(-1)[piece.begin : piece.end]


def chunked_dim(tensor: torch.Tensor, world_size: int, meshes: dict[int, bool]) -> int | None:
    """The dimension a DTensor is cut along when its mesh is every rank in order and its one
    placement is ``Shard(dim)`` (FSDP2's layout): rank ``k`` then holds block ``k`` of that
    dimension as ``torch.chunk`` cuts it. None for any other layout. ``meshes`` caches, by ``id``,
    whether each mesh seen (alive meanwhile) is every rank in order."""
    from torch.distributed.tensor import Shard

    dtensor: Any = tensor
    mesh, placements = dtensor.device_mesh, dtensor.placements
    if len(placements) != 1 or type(placements[0]) is not Shard:
        return None
    if id(mesh) not in meshes:
        meshes[id(mesh)] = mesh.ndim == 1 and torch.equal(mesh.mesh.cpu().long(), torch.arange(world_size))
    return placements[0].dim if meshes[id(mesh)] else None


def dtype_entry(tensor: torch.Tensor) -> str:
    """The dtype code a tensor is indexed with."""
    return DTYPE_CODES[tensor.dtype]
