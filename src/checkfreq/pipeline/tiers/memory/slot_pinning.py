"""Pinning the memory tier's slots for device copies, and the proof that it took.

A slot that CUDA tensors are copied into (or restored from) is registered with the CUDA runtime
once per mapping (:meth:`~checkfreq.storage.shm.MemoryRegion.pin_slot`), so its copies run on the
snapshot's side stream at the pinned bandwidth. A registration can succeed and the device still
not see the slot as pinned (``is_pinned()`` false: the copies then fall back to pageable ones,
synchronous and several times slower) — nothing else would say so. Such a slot is remembered, and
the first snapshot copied into one of them is reported in one warning with the bandwidth its
device-to-host copy reached, measured on the side stream by timing events
(:meth:`~checkfreq.pipeline.capture.snapshot.PendingSnapshot.host_copy`): the figure to compare with the
pinned bandwidth of the machine.
"""

from __future__ import annotations

import logging

from checkfreq.pipeline.capture.snapshot import PendingSnapshot
from checkfreq.storage.host_pinning import HostRegistry, host_registry
from checkfreq.storage.shm import MemoryRegion

log = logging.getLogger("checkfreq.memory")


class SlotPinning:
    """The memory tier's registrations: which slots the device does not see pinned, and the one warning."""

    def __init__(self) -> None:
        self.registry: HostRegistry | None = None
        """Registers the slots; created at the first CUDA snapshot or restore."""
        self._unseen: set[int] = set()
        self._warned = False

    def pin(self, region: MemoryRegion, slot: int) -> None:
        """Register ``slot`` of ``region`` for device copies (once per mapping); note it if the device
        does not see it pinned."""
        if self.registry is None:
            self.registry = host_registry()
        if slot in region.pinned_slots:
            return
        if not region.pin_slot(slot, self.registry):
            return  # refused: the registry said so once
        if self.registry.seen_pinned(region.slot_data(slot)):
            self._unseen.discard(slot)
        else:
            self._unseen.add(slot)

    def copied(self, slot: int, pending: PendingSnapshot) -> None:
        """A snapshot's copies into ``slot`` are done: the first one into a slot registered but not seen
        pinned is reported with the bandwidth its copy from the device reached."""
        if self._warned or slot not in self._unseen:
            return
        timed = pending.host_copy()
        if timed is None:  # no device copy was timed (a CPU snapshot)
            return
        self._warned = True
        nbytes, seconds = timed
        log.warning(
            "memory slot %d was registered for device copies but the device does not see it pinned: the copy of "
            "%.3f GB from the device into it ran at %.2f GB/s, the pageable bandwidth (a pinned copy runs several "
            "times faster, and asynchronously); each snapshot into such a slot costs the training that much more",
            slot,
            nbytes / 1e9,
            nbytes / max(seconds, 1e-9) / 1e9,
        )


__all__ = ["SlotPinning"]
