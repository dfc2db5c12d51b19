"""Plan, then I/O: which bytes each rank writes, and how a rank rebuilds its state from the pieces.

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
import dataclasses
import itertools
import logging
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, cast

import torch

from checkfreq.errors import CorruptCheckpointError
from checkfreq.ranks.compat import dtensor_class, dtensor_local_box
from checkfreq.ranks.replicas import ReplicaClaim
from checkfreq.run.tensors import is_dtensor
from checkfreq.storage.format import (
    DTYPE_CODES,
    DTYPES_BY_CODE,
    Manifest,
    TensorEntry,
    data_file_name,
    header_entries,
    rank_record,
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


@dataclass(frozen=True)
class Chunk:
    """A stored block of a global tensor: ``data`` sits at ``offset`` (one entry per dimension)."""

    data: torch.Tensor
    offset: tuple[int, ...]


@dataclass(frozen=True)
class Source:
    """Everything saved about one tensor: its global dtype, shape and the blocks that cover it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


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


Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offset, shape) of a block of a global tensor."""


def local_box(target: torch.Tensor) -> Box:
    """(offset, shape) of this rank's block of a DTensor ``target`` in its global tensor."""
    return dtensor_local_box(target)


def restored_block(shape: Sequence[int], target: torch.Tensor | None) -> Box:
    """The block a rank restores of a saved tensor of global ``shape``: its live DTensor ``target``'s
    own block, or the whole tensor (no target, or one of another shape: the loader reports that)."""
    shape = tuple(int(d) for d in shape)
    if target is None or tuple(target.shape) != shape:
        return (0,) * len(shape), shape
    return local_box(target)


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


def chunk_holders(shape: Sequence[int], dim: int, parts: int, box: Box) -> range:
    """The blocks, of the ``parts`` that ``torch.chunk`` cuts dimension ``dim`` of a tensor of
    global ``shape`` into, that hold some of ``box`` (the saved ranks whose shards it needs)."""
    offset, size = box
    step = -(-int(shape[dim]) // parts)
    if step == 0 or size[dim] == 0 or any(d == 0 for d in size):
        return range(0)
    return range(offset[dim] // step, min((offset[dim] + size[dim] - 1) // step + 1, parts))


def sharded_blocks(manifest: Manifest, targets: Mapping[str, torch.Tensor]) -> dict[str, Box]:
    """The block this rank restores of every sharded tensor of ``manifest`` (``targets``: the live
    DTensors by saved name, :func:`restore_targets`)."""
    saved = manifest.distributed["tensors"] if manifest.distributed else {}
    return {n: restored_block(e["shape"], targets.get(n)) for n, e in saved.items() if e["kind"] == SHARDED}


def uncovered(manifest: Manifest, blocks: Mapping[str, Box]) -> list[str]:
    """The sharded tensors whose block in ``blocks`` the shards ``manifest`` indexes do not cover
    (a manifest completed from some of the data files: their shards only)."""
    saved = manifest.distributed["tensors"] if manifest.distributed else {}
    short = []
    for name, (offset, shape) in blocks.items():
        parts = saved[name]["parts"] if name in saved else []
        held = sum(
            _overlap(tuple(o), tuple(manifest.tensors[stored]["shape"]), offset, shape)[2] for stored, o in parts
        )
        if held != _numel(shape):
            short.append(name)
    return short


# ---------------------------------------------------------------------------------- restore side


def local_view(
    manifest: Manifest,
    stored: Mapping[str, torch.Tensor],
    rank: int = 0,
    targets: Mapping[str, torch.Tensor] | None = None,
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The skeleton and tensors rank ``rank`` loads from a checkpoint written at any world size.

    ``stored`` are the arrays of the checkpoint's data files. A tensor whose name is in
    ``targets`` (a live DTensor) comes back as a DTensor with the target's placement, cut from
    whatever shards were saved; every other tensor comes back whole. Private state (and the
    skeleton: plain values, the loader's position) comes from saved rank
    ``source_rank(rank, saved_world_size)``; a private tensor that rank did not hold is left out.
    """
    meta = manifest.distributed
    if meta is None:
        skeleton = manifest.state
        sources = {n: Source(t.dtype, tuple(t.shape), (Chunk(t, (0,) * t.dim()),)) for n, t in stored.items()}
    else:
        try:
            ranks = meta["ranks"]
            source = source_rank(rank, len(ranks))
            skeleton = ranks[source]
            if skeleton is None:
                raise ValueError(f"saved rank {source}'s record was not read")
            sources = {n: _source(e, stored, source) for n, e in meta["tensors"].items() if _holds(e, source)}
        except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as e:
            raise CorruptCheckpointError(
                f"manifest's distributed index is malformed: {type(e).__name__}: {e}"
            ) from None
    targets = targets or {}
    return skeleton, {n: materialize(n, s, targets.get(n)) for n, s in sources.items()}


def check_assembles(manifest: Manifest, stored: Mapping[str, torch.Tensor]) -> None:
    """Raise :class:`CorruptCheckpointError` unless every tensor of ``manifest`` can be put together
    from the stored arrays as its index says (what a restore at any world size reads), one tensor at
    a time: memory holds at most one whole tensor besides the files."""
    meta = manifest.distributed or {"ranks": [], "tensors": {}}
    try:
        for rank in range(len(meta["ranks"])):
            for name, entry in meta["tensors"].items():
                if (rank == 0 or entry["kind"] == PRIVATE) and _holds(entry, rank):
                    materialize(name, _source(entry, stored, rank), None)
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as e:
        raise CorruptCheckpointError(f"manifest's distributed index is malformed: {type(e).__name__}: {e}") from None


def complete(manifest: Manifest, headers: Mapping[str, Mapping[str, Any]], partial: bool = False) -> Manifest:
    """``manifest`` with every rank's part added from its data file's header (``headers``: file name →
    parsed header): the index of every stored array, each rank's skeleton, and each tensor's parts.

    With ``partial``, ``headers`` may hold some of the files only: the ranks of the others get no
    skeleton (None) and no private or sharded parts, and their arrays are not indexed. A manifest
    that holds every rank's part already (one process, or schema version 1) is returned as it is.
    """
    if manifest.complete:
        return manifest
    try:
        files = [data_file_name(rank) for rank in range(manifest.world_size)]
        if sorted(files) != sorted(manifest.files):
            raise CorruptCheckpointError(
                f"manifest of {manifest.world_size} ranks lists the files {sorted(manifest.files)}"
            )
        read = [name for name in files if name in headers or not partial]
        index: dict[str, TensorEntry] = {}
        for name in read:
            index.update(header_entries(headers[name], name))
        records = {name: rank_record(headers[name], name) for name in read}
        per_rank = [records[name]["tensors"] if name in records else {} for name in files]
        assert manifest.distributed is not None  # an incomplete manifest was written by ranks
        tensors = _merge(manifest.distributed["tensors"], per_rank, index)
        ranks = [records[name]["state"] if name in records else None for name in files]
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise CorruptCheckpointError(f"checkpoint's per-rank records are malformed: {type(e).__name__}: {e}") from None
    distributed = {**manifest.distributed, "ranks": ranks, "tensors": tensors}
    return dataclasses.replace(manifest, tensors=index, state=ranks[0], distributed=distributed).checked()


def _merge(
    shared: Mapping[str, Any], per_rank: Sequence[Mapping[str, Any]], index: Mapping[str, Any]
) -> dict[str, Any]:
    """Every tensor's entry: the manifest's shared ones, with each rank's private tensors and shards added.

    A shard several ranks saved at one place (a replicated placement) is referred to once.
    """
    merged = {name: {**entry, "parts": list(entry["parts"])} for name, entry in shared.items()}
    boxes: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for rank, entries in enumerate(per_rank):
        for name, entry in entries.items():
            (part,) = entry["parts"]
            if entry["kind"] == PRIVATE:
                into = merged.setdefault(name, {**entry, "parts": [None] * len(per_rank)})
                if into["kind"] != PRIVATE:
                    raise ValueError(f"rank {rank} holds {name!r} as its own, the manifest as {into['kind']}")
                into["parts"][rank] = part
            elif entry["kind"] == SHARDED and merged[name]["kind"] == SHARDED:
                box = (tuple(part[1]), tuple(index[part[0]]["shape"]))
                if box not in boxes.setdefault(name, set()):
                    boxes[name].add(box)
                    merged[name]["parts"].append(part)
            else:
                raise ValueError(
                    f"rank {rank} records {name!r} as {entry['kind']}, the manifest as {merged[name]['kind']}"
                )
    return merged


def source_rank(rank: int, saved_world_size: int) -> int:
    """The saved rank whose private state rank ``rank`` restores: itself, or ``rank % saved_world_size``."""
    return rank % saved_world_size


def _holds(entry: Mapping[str, Any], rank: int) -> bool:
    """Whether saved rank ``rank`` has a part of this tensor (a private one may exist on some ranks only)."""
    return entry["kind"] != PRIVATE or entry["parts"][rank] is not None


def _source(entry: Mapping[str, Any], stored: Mapping[str, torch.Tensor], rank: int) -> Source:
    dtype, shape = DTYPES_BY_CODE[entry["dtype"]], tuple(int(d) for d in entry["shape"])
    kind, parts = entry["kind"], entry["parts"]
    if kind == PRIVATE:
        return Source(dtype, shape, (Chunk(_stored(stored, parts[rank]), (0,) * len(shape)),))
    if kind == SHARDED:
        chunks = tuple(Chunk(_stored(stored, name), tuple(int(o) for o in offset)) for name, offset in parts)
        return Source(dtype, shape, chunks)
    if kind != REPLICATED:
        raise ValueError(f"unknown tensor kind {kind!r}")
    if len(parts) == 1 and tuple(_stored(stored, parts[0][0]).shape) == shape:
        return Source(dtype, shape, (Chunk(_stored(stored, parts[0][0]), (0,) * len(shape)),))
    flat = torch.empty(_numel(shape), dtype=dtype)
    covered = 0
    for name, begin, end in parts:
        flat[begin:end] = _stored(stored, name).reshape(-1)
        covered += end - begin
    if covered != flat.numel():
        raise ValueError(f"pieces cover {covered} of {flat.numel()} elements")
    return Source(dtype, shape, (Chunk(flat.view(shape), (0,) * len(shape)),))


def _stored(stored: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in stored:
        raise KeyError(f"stored array {name!r} is not in the data files")
    return stored[name]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def materialize(name: str, source: Source, target: torch.Tensor | None) -> torch.Tensor:
    """The whole tensor, or (for a DTensor ``target``) a DTensor with the target's placement."""
    offset, shape = restored_block(source.shape, target)
    if target is None or tuple(target.shape) != source.shape:
        return _block(name, source, offset, shape)
    dtensor: Any = target
    local = _block(name, source, offset, shape).to(dtensor.to_local().device)
    return cast(torch.Tensor, dtensor_class().from_local(
        local, dtensor.device_mesh, dtensor.placements, run_check=False, shape=target.shape, stride=target.stride()
    ))


def _block(name: str, source: Source, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """Cut the box ``offset``/``shape`` out of the saved chunks (no copy when one chunk is the box)."""
    for chunk in source.chunks:
        if chunk.offset == offset and tuple(chunk.data.shape) == shape:
            return chunk.data
    out = torch.empty(shape, dtype=source.dtype)
    covered = 0
    for chunk in source.chunks:
        src, dst, n = _overlap(chunk.offset, tuple(chunk.data.shape), offset, shape)
        if n:
            out[dst] = chunk.data[src]
            covered += n
    if covered != out.numel():
        raise CorruptCheckpointError(f"saved shards of {name!r} cover {covered} of the {out.numel()} elements needed")
    return out


def _overlap(offset: tuple[int, ...], shape: tuple[int, ...], box_offset: tuple[int, ...],
             box_shape: tuple[int, ...]) -> tuple[tuple[slice, ...], tuple[slice, ...], int]:
    """Where the block ``offset``/``shape`` meets the box ``box_offset``/``box_shape``: the slices
    of each that hold the common elements, and their number."""
    src, dst, n = [], [], 1
    for o, s, bo, bs in zip(offset, shape, box_offset, box_shape, strict=True):
        lo, hi = max(o, bo), min(o + s, bo + bs)
        n *= max(hi - lo, 0)
        src.append(slice(lo - o, hi - o))
        dst.append(slice(lo - bo, hi - bo))
    return tuple(src), tuple(dst), n


def optimizer_targets(optimizers: Mapping[str, torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    """Optimizer-state name prefix → DTensor parameter, for state a fresh optimizer does not hold yet.

    Keys are ``"<optimizer>/state/<index>/"``: torch numbers parameters by position over the
    parameter groups, so saved state ``index`` belongs to the live parameter at that position.
    """
    targets = {}
    for opt_name, optimizer in optimizers.items():
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for index, param in enumerate(params):
            if is_dtensor(param):
                targets[f"{opt_name}/state/{index}/"] = param
    return targets


def restore_targets(
    live: Mapping[str, torch.Tensor], optimizers: Mapping[str, torch.optim.Optimizer], names: Sequence[str]
) -> dict[str, torch.Tensor]:
    """For each saved tensor name, the live DTensor whose placement it must be restored to."""
    targets = {n: t for n, t in live.items() if is_dtensor(t)}
    by_param = optimizer_targets(optimizers)
    for name in names:
        if name not in targets:
            prefix = name[: name.rfind("/") + 1]
            if prefix in by_param:
                targets[name] = by_param[prefix]
    return targets


def dtype_entry(tensor: torch.Tensor) -> str:
    """The dtype code a tensor is indexed with."""
    return DTYPE_CODES[tensor.dtype]


def note_world_size_change(manifest: Manifest, rank: int, world_size: int) -> None:
    """Say whose per-rank state ``rank`` takes when the checkpoint was written by another number of ranks."""
    if manifest.world_size == world_size:
        return
    dropped = ""
    if world_size < manifest.world_size and rank == 0:
        dropped = f"; the per-rank state of saved ranks {world_size}..{manifest.world_size - 1} is not restored"
    log.warning(
        "checkpoint at step %d was written by %d rank(s), this job has %d: rank %d restores the per-rank state "
        "(buffers, plain values, random generators) of saved rank %d and the parameters and optimizer state "
        "(whole, or its block of the sharded ones)%s (docs/distributed.md)",
        manifest.step, manifest.world_size, world_size, rank, source_rank(rank, manifest.world_size), dropped,
    )
