"""Phase 1: copy the training state into host buffers that are allocated once and reused.

Tensors the forward pass may mutate (BatchNorm statistics, anything not owned by an optimizer)
are copied before :meth:`Snapshotter.take` returns. Tensors only an optimizer changes
(parameters and optimizer state) are *deferred*: on CPU the writer thread copies them while the
next forward/backward runs; on CUDA they are copied on a side stream. Either way the returned
:class:`PendingSnapshot` is the fence that the next ``optimizer.step()`` waits on.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch

from checkfreq.format import BLOCK_BYTES, Layout, plan_layout, slot_view

CopyPairs = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class PendingSnapshot:
    """A snapshot whose deferred copies may still be running; see :meth:`wait_copied`."""

    layout: Layout
    buffer: torch.Tensor
    deferred_cpu: CopyPairs
    cuda_done: list[torch.cuda.Event] = field(default_factory=list)
    copied: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.cpu_fence = bool(self.deferred_cpu)
        """True if the fence must wait on the CPU for the writer to copy (CPU tensors were deferred)."""

    @property
    def has_deferred(self) -> bool:
        return self.cpu_fence or bool(self.cuda_done)

    def finish_copy(self) -> None:
        """Run in the writer: perform deferred CPU copies and wait for CUDA copies; then release the fence."""
        try:
            for dst, src in self.deferred_cpu:
                copy_on_this_thread(dst, src)
            for event in self.cuda_done:
                event.synchronize()
        finally:
            self.deferred_cpu = []
            self.copied.set()

    def order_after_copy(self) -> None:
        """Make the current CUDA streams wait for the side-stream copies (no CPU wait)."""
        for event in self.cuda_done:
            torch.cuda.current_stream(event.device).wait_event(event)


class Snapshotter:
    """Owns the reusable host buffer and the side CUDA streams."""

    def __init__(self) -> None:
        self._signature: tuple[object, ...] | None = None
        self._buffer: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def _views_for(self, layout: Layout, pin: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        signature = (layout.signature, pin)
        if signature != self._signature or self._buffer is None:
            self._buffer, self._views = None, []  # release the old buffer before allocating
            self._buffer = aligned_empty(layout.nbytes, pin)
            self._views = [slot_view(self._buffer, slot) for slot in layout.slots]
            self._signature = signature
        return self._buffer, self._views

    def take(self, tensors: Mapping[str, torch.Tensor], deferred: Collection[str]) -> PendingSnapshot:
        """Copy ``tensors`` into the host buffer; names in ``deferred`` may be copied later (fenced)."""
        layout = plan_layout({name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()})
        pin = torch.cuda.is_available() and any(t.is_cuda for t in tensors.values())
        buffer, views = self._views_for(layout, pin)
        now_cpu: CopyPairs = []
        later_cpu: CopyPairs = []
        cuda_now: dict[torch.device, CopyPairs] = {}
        cuda_later: dict[torch.device, CopyPairs] = {}
        for slot, view in zip(layout.slots, views):
            src = tensors[slot.name]
            later = slot.name in deferred
            if src.is_cuda:
                (cuda_later if later else cuda_now).setdefault(src.device, []).append((view, src))
            else:
                (later_cpu if later else now_cpu).append((view, src))
        pending = PendingSnapshot(layout, buffer, later_cpu)
        for device in set(cuda_now) | set(cuda_later):
            pending.cuda_done.append(self._copy_on_side_stream(device, cuda_now.get(device, []), cuda_later.get(device, [])))
        with torch.no_grad():
            for dst, src in now_cpu:
                dst.copy_(src)
        if not pending.has_deferred:
            pending.copied.set()
        return pending

    def _copy_on_side_stream(self, device: torch.device, now: CopyPairs, later: CopyPairs) -> torch.cuda.Event:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)
        with torch.no_grad(), torch.cuda.stream(stream):
            for dst, src in now:
                dst.copy_(src, non_blocking=True)
            now_done = torch.cuda.Event()
            now_done.record(stream)
            for dst, src in later:
                dst.copy_(src, non_blocking=True)
            all_done = torch.cuda.Event()
            all_done.record(stream)
        current.wait_event(now_done)  # the next forward runs only after forward-mutated tensors are copied
        return all_done


def copy_on_this_thread(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a CPU tensor into its buffer slot (same dtype and shape) with one thread, GIL released.

    The writer must not use ``Tensor.copy_`` for this: ATen would start a second OpenMP team
    in the writer thread, which oversubscribes the cores the training loop's team runs on and
    slows every later iteration, not only those the copy overlaps (docs/performance.md).
    ``ctypes.memmove`` is one ``memmove`` that releases the GIL. Views that are not plain
    contiguous memory (strided, lazily conjugated or negated) take ``copy_``.
    """
    if src.is_contiguous() and not (src.is_conj() or src.is_neg()) and dst.is_contiguous() and src.dtype == dst.dtype:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    else:
        with torch.no_grad():
            dst.copy_(src)


def aligned_empty(nbytes: int, pin: bool) -> torch.Tensor:
    """A flat ``uint8`` host buffer starting at a :data:`BLOCK_BYTES`-aligned address (for direct I/O)."""
    raw = torch.empty(nbytes + BLOCK_BYTES, dtype=torch.uint8, pin_memory=pin)
    start = -raw.data_ptr() % BLOCK_BYTES
    return raw[start : start + nbytes]
