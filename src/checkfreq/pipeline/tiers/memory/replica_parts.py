"""What a copy of a memory snapshot on another machine carries (``replicas=``), and the whole snapshot
made again from it where it is kept.

Under data parallelism a rank's slot holds its share of its machine's one copy of the replicated state
(:mod:`checkfreq.ranks.group_share`) beside its own private tensors and shards; every other machine
holds that replicated state too, in the same pieces when it has as many ranks (a piece's stored name
says which elements it holds). So a copy carries only the bytes no other machine holds: the slot's
data without its replicated pieces (a run of them of at least :data:`OMIT_MIN_BYTES`; shorter runs
between private bytes travel with them, so that a sharded slot with a few small replicated counters
goes whole, as one stream), and, as its manifest, an *envelope*: the slot's own manifest, the size and
checksum of the slot's whole data, and the stored names left out. The keeper checks the copy against
a checksum of what was sent (:func:`outgoing`), as for a whole slot.

At a restore the keeper makes the slot whole again (:func:`whole`): the bytes sent, in place, and
each piece left out read from a region of its own machine that holds the same step (verified), and
the result must match the checksum of the sender's slot before it is used: a copy is checked end to
end, from the sender's slot to the slot a rank adopts. :func:`usable_steps` says which copies a
machine can make whole, from slot headers and manifests alone (what the restore's first round
reports).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from checkfreq.errors import CheckfreqError
from checkfreq.pipeline.tiers.roles import HeldCopy
from checkfreq.ranks.shares import REPLICATED
from checkfreq.storage.format import CHUNK_BYTES, Manifest
from checkfreq.storage.shm import MemoryRegion, SlotInfo, slot_digest
from checkfreq.storage.shm_listing import listed_regions

OMIT_MIN_BYTES = 4096
"""The shortest run of replicated bytes a copy leaves out."""
REPLICA_PIECE_BYTES = CHUNK_BYTES
"""A replica copy's data travels in pieces of this size (the last one shorter): each is one chunk of its
checksum (``storage.format.CHUNK_BYTES``)."""
_MAGIC = b"CKFQPART"
_ENVELOPE = struct.Struct("<8sQQQ")  # magic, the slot's data bytes, the slot's checksum, bytes of the names' JSON


@dataclass(frozen=True)
class Outgoing:
    """One snapshot's copy, ready to send: its header, its manifest (the slot's, or an envelope) and its data."""

    info: SlotInfo
    """The copy's own header: step and signature of the slot, the copy's sizes and checksum."""
    meta: bytes
    runs: list[tuple[int, int]]
    """The byte ranges of the slot's data the copy carries, in order."""
    data: torch.Tensor
    """The slot's data (a view of it)."""

    def pieces(self) -> Iterator[torch.Tensor]:
        """The data the copy carries, in pieces of :data:`REPLICA_PIECE_BYTES` (:func:`pieces_of` on the
        keeper): views of the slot when one run holds a piece, else gathered into a buffer reused for each."""
        staging: torch.Tensor | None = None
        for views in _chunks(self.data, self.runs):
            if len(views) == 1:
                yield views[0]
                continue
            size = sum(v.numel() for v in views)
            if staging is None:
                staging = torch.empty(min(REPLICA_PIECE_BYTES, self.info.data_bytes), dtype=torch.uint8)
            torch.cat(views, out=staging[:size])
            yield staging[:size]


def pieces_of(buffer: torch.Tensor, nbytes: int) -> Iterator[torch.Tensor]:
    """The first ``nbytes`` of ``buffer`` in the pieces :meth:`Outgoing.pieces` sends them in."""
    for at in range(0, nbytes, REPLICA_PIECE_BYTES):
        yield buffer[at : min(at + REPLICA_PIECE_BYTES, nbytes)]


def outgoing(data: torch.Tensor, meta: bytes, info: SlotInfo) -> Outgoing:
    """The copy of the committed slot ``info`` (its ``data`` and manifest ``meta``): whole when it holds
    no run of replicated pieces worth leaving out, else without them (module docstring)."""
    omitted = _replicated_runs(meta)
    if not omitted:
        return Outgoing(info, meta, [(0, info.data_bytes)] if info.data_bytes else [], data)
    names = json.dumps(sorted(name for _, _, run in omitted for name in run)).encode()
    envelope = _ENVELOPE.pack(_MAGIC, info.data_bytes, info.checksum, len(names)) + names + meta
    runs = _complement([(begin, end) for begin, end, _ in omitted], info.data_bytes)
    digests = b"".join(_hash(views) for views in _chunks(data, runs))
    hasher = xxhash.xxh3_64(digests)
    hasher.update(envelope)
    checksum = hasher.intdigest() or 1  # as storage.shm.slot_digest: never PENDING
    sent = sum(end - begin for begin, end in runs)
    return Outgoing(
        dataclasses.replace(info, data_bytes=sent, meta_bytes=len(envelope), checksum=checksum), envelope, runs, data
    )


def manifest_bytes(meta: bytes) -> bytes:
    """The slot's manifest in a copy's ``meta`` (an envelope, or the manifest itself)."""
    return _unpack(meta)[3] if meta.startswith(_MAGIC) else meta


def whole(directory: str | os.PathLike[str], copy: HeldCopy) -> HeldCopy:
    """``copy`` (kept here, verified) as its sender's slot held it: itself when it was sent whole, else
    its data put back in place and the pieces it left out read from this machine's regions of checkpoint
    ``directory`` at its step, checked against the sender's checksum. A :class:`CheckfreqError` naming
    the rank, the step and what is missing or wrong otherwise."""
    if not copy.meta.startswith(_MAGIC):
        return copy
    what = f"the copy of rank {copy.rank}'s memory snapshot {copy.step}"
    data_bytes, checksum, names, meta = _unpack(copy.meta)
    entries = Manifest.from_json(meta, step=copy.step).tensors
    left_out = set(names)
    omitted = [span for span in _spans(entries) if span[2] in left_out]
    if len(omitted) != len(names):
        raise CheckfreqError(f"{what} leaves out pieces its manifest does not list")
    runs = _complement([(begin, end) for begin, end, _ in omitted], data_bytes)
    if sum(end - begin for begin, end in runs) != copy.data.numel():
        raise CheckfreqError(
            f"{what} holds {copy.data.numel()} bytes, not the {data_bytes} bytes of its slot less the pieces it names"
        )
    data, at = torch.empty(data_bytes, dtype=torch.uint8), 0
    for begin, end in runs:
        data[begin:end] = copy.data[at : at + end - begin]
        at += end - begin
    missing = _fill(directory, copy.step, copy.course, {name: (begin, end) for begin, end, name in omitted}, data)
    if missing:
        raise CheckfreqError(
            f"{what} left out replicated pieces no region of this machine holds at that step "
            f"(e.g. {missing[0]!r}; {len(missing)} in all)"
        )
    if slot_digest(data.numpy().data, meta) != checksum:
        raise CheckfreqError(
            f"{what}, put together with this machine's replicated pieces, does not match the "
            "checksum of its sender's slot"
        )
    return dataclasses.replace(copy, meta=meta, data=data, checksum=checksum)


def usable_steps(directory: str | os.PathLike[str], copies: MemoryRegion) -> list[tuple[int, int]]:
    """The (step, course) of the copies in region ``copies`` that this machine can make whole
    (:func:`whole`): each sent whole, or every piece it left out listed, with its size, by a region of
    this machine at its step and course (slot headers and manifests only: nothing is verified here)."""
    steps: list[tuple[int, int]] = []
    held = None
    for info in copies.snapshots():
        meta = copies.slot_bytes(info)[1]
        if not meta.startswith(_MAGIC):
            steps.append((info.step, info.course))
            continue
        try:
            _, _, names, manifest = _unpack(meta)
            entries = Manifest.from_json(manifest).tensors
            held = _listed(directory) if held is None else held
            if all(
                name in entries and held.get((info.step, info.course, name)) == _size(entries[name]) for name in names
            ):
                steps.append((info.step, info.course))
        except (CheckfreqError, KeyError, TypeError, ValueError):
            continue  # damaged: the restore will not count on it
    return steps


# ---------------------------------------------------------------------- helpers


def _replicated_runs(meta: bytes) -> list[tuple[int, int, list[str]]]:
    """(begin, end, stored names) of each run of the slot's replicated pieces, laid end to end, of at
    least :data:`OMIT_MIN_BYTES`."""
    manifest = Manifest.from_json(meta)
    split = manifest.distributed
    if not split:
        return []
    replicated = {
        part[0]
        for record in split.get("tensors", {}).values()
        if record.get("kind") == REPLICATED
        for part in record.get("parts", ())
        if isinstance(part, list) and part
    }
    runs: list[tuple[int, int, list[str]]] = []
    in_run = False  # the array before this one was replicated: the layout lays arrays end to end
    for begin, end, name in _spans(manifest.tensors):
        if name not in replicated:
            in_run = False
        elif in_run:
            runs[-1] = (runs[-1][0], end, [*runs[-1][2], name])
        else:
            runs.append((begin, end, [name]))
            in_run = True
    return [run for run in runs if run[1] - run[0] >= OMIT_MIN_BYTES]


def _complement(omitted: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The ranges of ``[0, size)`` outside the sorted, disjoint ``omitted`` ranges, in order (none empty)."""
    runs, at = [], 0
    for begin, end in omitted:
        if begin > at:
            runs.append((at, begin))
        at = end
    if size > at:
        runs.append((at, size))
    return runs


def _chunks(data: torch.Tensor, runs: list[tuple[int, int]]) -> Iterator[list[torch.Tensor]]:
    """The bytes of ``runs`` of ``data``, laid end to end, cut in :data:`REPLICA_PIECE_BYTES`: each piece as
    its views."""
    views: list[torch.Tensor] = []
    room = REPLICA_PIECE_BYTES
    for begin, end in runs:
        while begin < end:
            take = min(room, end - begin)
            views.append(data[begin : begin + take])
            begin, room = begin + take, room - take
            if room == 0:
                yield views
                views, room = [], REPLICA_PIECE_BYTES
    if views:
        yield views


def _hash(views: list[torch.Tensor]) -> bytes:
    """xxh3-64 of the views' bytes laid end to end (one chunk of a checksum: storage.parallel_hash)."""
    hasher = xxhash.xxh3_64()
    for view in views:
        hasher.update(view.numpy().data)
    return hasher.digest()


def _unpack(meta: bytes) -> tuple[int, int, list[str], bytes]:
    """(the slot's data bytes, its checksum, the names left out, its manifest) of an envelope."""
    if len(meta) < _ENVELOPE.size:
        raise CheckfreqError("a copy's envelope is truncated")
    _, data_bytes, checksum, length = _ENVELOPE.unpack_from(meta)
    try:
        names = json.loads(meta[_ENVELOPE.size : _ENVELOPE.size + length])
    except ValueError as e:
        raise CheckfreqError(f"a copy's envelope does not name what it left out: {e}") from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckfreqError("a copy's envelope does not name what it left out")
    return data_bytes, checksum, names, meta[_ENVELOPE.size + length :]


def _size(entry: Mapping[str, Any]) -> int:
    begin, end = entry["offsets"]
    return int(end) - int(begin)


def _spans(entries: Mapping[str, Mapping[str, Any]]) -> list[tuple[int, int, str]]:
    """(begin, end, stored name) of each array of a manifest's index, in the order they lie."""
    return sorted((int(entry["offsets"][0]), int(entry["offsets"][1]), name) for name, entry in entries.items())


def _listed(directory: str | os.PathLike[str]) -> dict[tuple[int, int, str], int]:
    """(step, course, stored name) → bytes of every array the manifests of this machine's regions list."""
    held: dict[tuple[int, int, str], int] = {}
    for _, region in listed_regions(directory):
        try:
            for info in region.snapshots():
                try:
                    entries = Manifest.from_json(region.slot_bytes(info)[1]).tensors
                except CheckfreqError:
                    continue
                for name, entry in entries.items():
                    held[(info.step, info.course, name)] = _size(entry)
        finally:
            region.release(remove=False)
    return held


def _fill(
    directory: str | os.PathLike[str], step: int, course: int, wanted: dict[str, tuple[int, int]], data: torch.Tensor
) -> list[str]:
    """Copy into ``data`` each of ``wanted`` (stored name → its range) from a verified region of this
    machine at ``step`` of ``course``; the names no region held."""
    left = dict(wanted)
    for _, region in listed_regions(directory):
        try:
            if not left or not any((info.step, info.course) == (step, course) for info in region.snapshots()):
                continue
            found = region.newest(step, course)
            if found is None:
                continue
            _, meta, source = found
            for name, entry in Manifest.from_json(meta).tensors.items():
                if name in left and _size(entry) == left[name][1] - left[name][0]:
                    begin, end = left.pop(name)
                    at = int(entry["offsets"][0])
                    data[begin:end] = source[at : at + end - begin]
        finally:
            region.release(remove=False)
    return sorted(left)
