"""How a rank rebuilds its state from the pieces the ranks wrote (:mod:`checkfreq.ranks.shares` says
which bytes each rank writes): a manifest completed from the data files' headers, the blocks of
sharded tensors a rank restores, and each tensor assembled from the saved pieces, whole or cut to
this rank's block, at any world size.

Pure functions of the manifest, the stored arrays and the live targets; no communication and no storage.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from checkfreq.errors import CorruptCheckpointError
from checkfreq.ranks.compat import dtensor_class, dtensor_local_box
from checkfreq.ranks.shares import PRIVATE, REPLICATED, SHARDED
from checkfreq.run.tensors import is_dtensor
from checkfreq.storage.format import (
    DTYPES_BY_CODE,
    Manifest,
    TensorEntry,
    data_file_name,
    header_entries,
    rank_record,
)

log = logging.getLogger("checkfreq")


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
    return cast(
        torch.Tensor,
        dtensor_class().from_local(
            local, dtensor.device_mesh, dtensor.placements, run_check=False, shape=target.shape, stride=target.stride()
        ),
    )


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


def _overlap(
    offset: tuple[int, ...], shape: tuple[int, ...], box_offset: tuple[int, ...], box_shape: tuple[int, ...]
) -> tuple[tuple[slice, ...], tuple[slice, ...], int]:
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
        manifest.step,
        manifest.world_size,
        world_size,
        rank,
        source_rank(rank, manifest.world_size),
        dropped,
    )
