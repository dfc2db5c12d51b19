"""A memory snapshot on its way into a slot: the slot, and the manifest its metadata holds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from checkfreq.pipeline.tiers.roles import SnapshotRequest
from checkfreq.storage.format import Layout, Manifest, TensorEntry, slot_view, tensor_entries
from checkfreq.storage.shm import MemoryRegion, OpenSlot

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
    views: list[torch.Tensor] | None = None
    """A typed view of the slot for each tensor of ``layout``, in its order (None: made from ``buffer``)."""

    @property
    def buffer(self) -> torch.Tensor:
        return self.slot.data[: self.layout.nbytes]


class SlotViews:
    """The views of each slot for a layout, made once per slot, layout and mapping of the region
    rather than once per snapshot (thousands of tensors cost thousands of views)."""

    def __init__(self) -> None:
        self._made: dict[int, list[torch.Tensor]] = {}
        self._for: tuple[int, Layout] | None = None

    def of(self, region: MemoryRegion, slot: OpenSlot, layout: Layout) -> list[torch.Tensor]:
        """The views of ``layout``'s tensors in ``slot`` of ``region``, as mapped now."""
        if self._for is None or self._for[0] != region.mapping or self._for[1] is not layout:
            self._made, self._for = {}, (region.mapping, layout)
        views = self._made.get(slot.slot)
        if views is None:
            buffer = slot.data[: layout.nbytes]
            views = self._made[slot.slot] = [slot_view(buffer, entry) for entry in layout.slots]
        return views

    def clear(self) -> None:
        """Drop every view (the region is about to be unmapped)."""
        self._made, self._for = {}, None


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
