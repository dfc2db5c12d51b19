"""The GPU staging buffer: a snapshot copied device-to-device first, then to the host in the background.

A device-to-host copy of a 12.5 GB state takes about 0.23 s even pinned (55 GB/s on PCIe gen5),
as long as a training step of a 1B-parameter model; a device-to-device copy of it takes about
8 ms (1.5 TB/s on an H100). With a staging buffer, the snapshot's copy on the side stream is a
D2D copy into one reused flat device buffer, and only that is what the next optimizer step's
fence waits for; the copy from the staging buffer to the host (a memory slot or the persist
buffer) follows on the same side stream while the next steps compute. Stream order makes the
next snapshot's D2D copy wait for the previous D2H copy, so one buffer is enough.

It costs device memory, so it is used by default only when the state fits in at most half of
what is free on the device when the first snapshot is taken (after the first steps, when the
activations and the optimizer state exist): :func:`choose_staging`. ``gpu_staging=True``/``False``
forces it on or off. The choice is logged once per device, with the figures.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from checkfreq.errors import InvalidArgumentError

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
    """Stage through device memory if forced, or if ``state_bytes`` fit in half of ``free_bytes``."""
    state, free = f"{state_bytes / 1e9:.2f} GB", f"{free_bytes / 1e9:.2f} GB"
    if force is not None:
        return StagingChoice(force, f"gpu_staging={force} (forced)")
    if 2 * state_bytes <= free_bytes:
        return StagingChoice(True, f"the state's {state} fit in half of the {free} free on the device: copied there "
                                   "first (milliseconds), then to the host in the background")
    return StagingChoice(False, f"the state's {state} do not fit in half of the {free} free on the device: copied "
                                "straight to the host on the side stream (gpu_staging=True forces the staging buffer)")


def staging_offsets(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Where each of tensors of ``nbytes`` starts in the staging buffer, and the buffer's size."""
    offsets, at = [], 0
    for n in nbytes:
        offsets.append(at)
        at += -(-n // ALIGN) * ALIGN
    return offsets, at


def free_device_bytes(device: torch.device) -> int:
    """Bytes this process could allocate on ``device`` now: free on the device, plus what the
    caching allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


class StagingBuffer:
    """One device's reused staging buffer: views shaped like the tensors staged through it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffer: torch.Tensor | None = None
        self._signature: tuple[object, ...] | None = None
        self._views: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def views_for(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Contiguous views of the buffer, one per tensor (same dtype and shape); the buffer is
        allocated again only when the tensors' dtypes or shapes change."""
        signature = tuple((t.dtype, tuple(t.shape)) for t in tensors)
        if signature != self._signature or self._buffer is None:
            sizes = [t.numel() * t.element_size() for t in tensors]
            offsets, total = staging_offsets(sizes)
            self._buffer, self._views = None, []  # release the old buffer before allocating
            self._buffer = torch.empty(total, dtype=torch.uint8, device=self.device)
            self._views = [self._buffer[at : at + n].view(t.dtype).view(t.shape)
                           for at, n, t in zip(offsets, sizes, tensors, strict=True)]
            self._signature = signature
        return self._views
