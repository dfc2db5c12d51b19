"""The GPU staging buffer: a snapshot copied device-to-device first, then to the host in the background.

A device-to-host copy of a 12.5 GB state takes about 0.23 s even pinned (55 GB/s on PCIe gen5),
as long as a training step of a 1B-parameter model; a device-to-device copy of it takes about
8 ms (1.5 TB/s on an H100). With a staging buffer, the snapshot's copy on the side stream is a
D2D copy into one reused flat device buffer, and only that is what the next optimizer step's
fence waits for; the copy from the staging buffer to the host (a memory slot or the persist
buffer) follows on the same side stream while the next steps compute. Stream order makes the
next snapshot's D2D copy wait for the previous D2H copy, so one buffer is enough.

It costs device memory, so it is used by default only when the state fits in at most half of the
device memory a training step leaves: what is free on the device plus what the caching allocator
holds, less the peak allocated over the steps run so far (the reserved-but-unused blocks are where
the next forward's activations go, so they are not counted as room). The choice is made at the
first snapshot after a whole step has run in this process (the optimizer state and the activations
then exist; a snapshot before that goes straight to the host), and made again whenever the state
outgrows the buffer: :func:`choose_staging`. ``gpu_staging=True``/``False`` forces it on or off.
The choice is logged, with the figures. If the buffer cannot be allocated even so, the snapshot
goes straight to the host and so do the later ones (logged once).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from checkfreq.errors import InvalidArgumentError
from checkfreq.pipeline.capture.device_ops import DeviceOps

log = logging.getLogger("checkfreq.snapshot")

ALIGN = 256
"""Each tensor's place in the staging buffer starts at a multiple of this (any dtype's alignment)."""


@dataclass(frozen=True)
class StagingChoice:
    """Whether snapshots of one device go through a staging buffer, and why."""

    use: bool
    reason: str


def check_gpu_staging(value: object) -> bool | None:
    """The ``gpu_staging`` option, checked: None, True or False."""
    if value is not None and not isinstance(value, bool):
        raise InvalidArgumentError(f"gpu_staging must be None, True or False, got {value!r}")
    return value


def choose_staging(state_bytes: int, free_bytes: int, force: bool | None) -> StagingChoice:
    """Stage through device memory if forced, or if ``state_bytes`` fit in half of ``free_bytes``
    (:func:`staging_room`)."""
    state, free = f"{state_bytes / 1e9:.2f} GB", f"{free_bytes / 1e9:.2f} GB"
    if force is not None:
        return StagingChoice(force, f"gpu_staging={force} (forced)")
    if 2 * state_bytes <= free_bytes:
        return StagingChoice(
            True,
            f"the state's {state} fit in half of the {free} a training step leaves free on the "
            "device: copied there first (milliseconds), then to the host in the background",
        )
    return StagingChoice(
        False,
        f"the state's {state} do not fit in half of the {free} a training step leaves free on "
        "the device: copied straight to the host on the side stream (gpu_staging=True forces "
        "the staging buffer)",
    )


def staging_offsets(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Where each of tensors of ``nbytes`` starts in the staging buffer, and the buffer's size."""
    offsets, at = [], 0
    for n in nbytes:
        offsets.append(at)
        at += -(-n // ALIGN) * ALIGN
    return offsets, at


def staging_room(free_bytes: int, reserved_bytes: int, peak_bytes: int, held_bytes: int) -> int:
    """Device memory a staging buffer may take: free on the device plus what the caching allocator
    holds (``reserved_bytes``), less the peak a training step allocated (``peak_bytes``, which
    includes the staging buffer held now, ``held_bytes``, given back before a larger one is made)."""
    return max(0, free_bytes + reserved_bytes - peak_bytes + held_bytes)


class StagingBuffer:
    """One device's reused staging buffer: views shaped like the tensors staged through it."""

    def __init__(self, device: torch.device, ops: DeviceOps) -> None:
        self.device, self._ops = device, ops
        self._buffer: torch.Tensor | None = None
        self._signature: tuple[object, ...] | None = None
        self._views: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def fits(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` are staged through the buffer held now (no new allocation)."""
        return self._buffer is not None and self._signature == tuple((t.dtype, tuple(t.shape)) for t in tensors)

    def release(self) -> None:
        """Give the buffer back (the copies out of it must be done: the side stream's last event passed)."""
        self._buffer, self._views, self._signature = None, [], None

    def views_for(self, tensors: Sequence[torch.Tensor], stream: object = None) -> list[torch.Tensor]:
        """Contiguous views of the buffer, one per tensor (same dtype and shape); the buffer is
        allocated again (for use on ``stream``) only when the tensors' dtypes or shapes change."""
        signature = tuple((t.dtype, tuple(t.shape)) for t in tensors)
        if signature != self._signature or self._buffer is None:
            sizes = [t.numel() * t.element_size() for t in tensors]
            offsets, total = staging_offsets(sizes)
            self._buffer, self._views = None, []  # release the old buffer before allocating
            self._buffer = self._ops.empty(total, self.device, stream)
            self._views = [
                self._buffer[at : at + n].view(t.dtype).view(t.shape)
                for at, n, t in zip(offsets, sizes, tensors, strict=True)
            ]
            self._signature = signature
        return self._views
