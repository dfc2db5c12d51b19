"""A memory snapshot on its way into a slot: the slot, and the manifest its metadata holds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from checkfreq.pipeline.tiers.roles import SnapshotRequest
from checkfreq.storage.format import Layout, Manifest, TensorEntry, tensor_entries
from checkfreq.storage.shm import OpenSlot

SEAL_AFTER_BYTES = 256 << 20
"""Snapshots from a GPU at least this large are committed before their checksum, computed afterwards."""


def seal_later(device_copies: bool, nbytes: int) -> bool:
    """Whether a snapshot is committed before its checksum (:meth:`MemoryRegion.seal` adds it)."""
    return device_copies and nbytes >= SEAL_AFTER_BYTES


@dataclass(frozen=True)
class MemoryTarget:
    """A snapshot on its way into a slot: the slot, and what its header and metadata will say."""

    slot: OpenSlot
    step: int
    layout: Layout
    meta: bytes
    setup_s: float
    """Seconds spent creating the region for this snapshot (a one-time cost, not the cadence's)."""
    seal_later: bool = False
    """Committed before its checksum, sealed afterwards (a large snapshot from a GPU)."""

    @property
    def buffer(self) -> torch.Tensor:
        return self.slot.data[: self.layout.nbytes]


class SlotManifests:
    """The manifest of each snapshot a rank's slots hold, as bytes. Its tensor index is made again
    only for another layout: the saver hands every snapshot of an unchanged state the same layout
    object, so a snapshot of thousands of tensors builds no entry per tensor."""

    def __init__(self, data_file: str) -> None:
        self._data_file = data_file
        self._entries: tuple[Layout, dict[str, TensorEntry]] | None = None

    def meta(self, request: SnapshotRequest) -> bytes:
        """The manifest of the snapshot ``request`` asks for (the slot header holds its checksum)."""
        layout = request.layout
        if self._entries is None or self._entries[0] is not layout:
            self._entries = (layout, tensor_entries(layout, self._data_file))
        return Manifest(
            step=request.step,
            epoch=request.epoch,
            world_size=1 if request.split is None else request.split["world_size"],  # the job's, for the events
            files={self._data_file: {"size": layout.nbytes, "xxh3_64": ""}},
            tensors=self._entries[1],
            state=request.skeleton,
            versions=request.versions,
            created=request.created,
            distributed=request.split,
        ).to_json()
