"""Phase 1: copy the training state into host buffers that are allocated once and reused.

Tensors the forward pass may mutate (BatchNorm statistics, anything not owned by an optimizer)
are copied before :meth:`Snapshotter.take` returns. Tensors only an optimizer changes
(parameters and optimizer state) are *deferred*: on CPU the writer thread copies them while the
next forward/backward runs; on CUDA they are copied on a side stream. Either way the returned
:class:`PendingSnapshot` is the fence that the next ``optimizer.step()`` waits on.

On CUDA the host buffer is pinned (the snapshotter's own, or a memory slot registered with the
CUDA runtime), so the side stream's copies are asynchronous. Where device memory allows, the side
stream first copies the state into a reused device buffer (:mod:`checkfreq.pipeline.capture.staging`):
the fence then waits only for that device-to-device copy, and the copy to the host follows on the
side stream while training goes on. The training stream's waits on the side stream are timed on
the GPU (:mod:`checkfreq.pipeline.capture.gpu_waits`).

Three rules keep the side stream's copies exact and the training thread free:

* every CUDA source is ``record_stream``-ed on the side stream, so the caching allocator never hands
  its memory to the next forward before the side stream has read it, even when the source is a
  temporary (a DDP share's piece, a tensor an optimizer's ``state_dict()`` built) freed as soon as
  the snapshot is taken;
* the fence blocks the CPU only for the CPU tensors deferred (an optimizer's ``step`` counter of a
  non-fused Adam); CUDA copies are ordered by events on the streams, never waited for on the CPU;
* the next forward waits for the side stream only where forward-mutated CUDA tensors were copied.

The CUDA calls go through :class:`~checkfreq.pipeline.capture.device_ops.DeviceOps`, so that tests run
this logic on a CPU with a fake that records their order.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from checkfreq.pipeline.capture.device_ops import CUDA, DeviceOps
from checkfreq.pipeline.capture.gpu_waits import GpuWaits
from checkfreq.pipeline.capture.staging import StagingBuffer, choose_staging, staging_room
from checkfreq.storage.format import BLOCK_BYTES, Layout, plan_layout, slot_view
from checkfreq.storage.host_buffer import RegisteredBuffer
from checkfreq.storage.host_pinning import HostRegistry, host_registry

log = logging.getLogger("checkfreq.snapshot")

CopyPairs = list[tuple[torch.Tensor, torch.Tensor]]

Specs = dict[str, tuple[torch.dtype, tuple[int, ...]]]
"""Tensors' names → their dtypes and shapes: what a layout is planned from."""


DEFERRED_COPY_PIECE_BYTES = 4 << 20
"""Deferred copies are split into pieces of at most this size, so the writer and the fence can share them."""

CopyPiece = tuple[int, int, int] | tuple[torch.Tensor, torch.Tensor]
"""``(dst address, src address, bytes)`` for plain memory, or a ``(dst, src)`` pair for ``copy_``."""


@dataclass
class PendingSnapshot:
    """A snapshot whose deferred copies may still be running.

    The writer copies the deferred CPU tensors piece by piece (:meth:`finish_copy`); if the next
    ``optimizer.step()`` arrives first, the training thread claims the remaining pieces too
    (:meth:`copy_pieces`), so the fence lasts as long as a copy on two threads, not on one. The
    first of the two to copy cuts the copies into pieces: the writer, as a rule, so that this work,
    which grows with the number of tensors, stays off the training thread.
    """

    layout: Layout
    buffer: torch.Tensor
    deferred_cpu: CopyPairs
    cuda_done: list[Any] = field(default_factory=list)
    """One event per device: its side stream finished every copy to the host."""
    cuda_fence: list[tuple[torch.device, Any]] = field(default_factory=list)
    """One (device, event) per device: the state was copied (to the host, or to the staging buffer)."""
    copied: threading.Event = field(default_factory=threading.Event)
    """Set by the writer once every deferred copy is done (or has failed)."""
    waits: GpuWaits | None = None
    step: int = 0
    memory: bool = False
    ops: DeviceOps = CUDA
    host_copies: list[tuple[Any, Any, int]] = field(default_factory=list)
    """One (start, end, bytes) per device: timing events around its side stream's copies to the host."""
    aside: dict[str, torch.Tensor] = field(default_factory=dict)
    """Host copies of the tensors :meth:`Snapshotter.take` was given ``aside``, by name: complete once
    :meth:`finish_copy` returned."""

    def __post_init__(self) -> None:
        self.cpu_fence = bool(self.deferred_cpu)
        """True if the fence must wait on the CPU for the writer to copy (CPU tensors were deferred)."""
        self._pieces: list[CopyPiece] | None = None  # cut by the first thread to copy
        self._claims = itertools.count()  # next() on a count is atomic: each piece is claimed once
        self._left = 0
        self._lock = threading.Lock()
        self._pieces_done = threading.Event()
        self._failed: BaseException | None = None
        if not self.deferred_cpu:
            self._pieces = []
            self._pieces_done.set()

    @property
    def has_deferred(self) -> bool:
        return self.cpu_fence or bool(self.cuda_done)

    @property
    def cpu_copied(self) -> threading.Event:
        """Set once every deferred CPU piece is copied (or one failed): all the fence waits for on the CPU."""
        return self._pieces_done

    def _cut(self) -> list[CopyPiece]:
        """The deferred copies in pieces, cut once, by the first thread that copies."""
        with self._lock:
            if self._pieces is None:
                self._pieces = [piece for dst, src in self.deferred_cpu for piece in _pieces(dst, src)]
                self._left = len(self._pieces)
                if not self._pieces:
                    self._pieces_done.set()
            return self._pieces

    def copy_pieces(self) -> None:
        """Copy unclaimed pieces until none is left; the writer and the fence both call this."""
        try:
            pieces = self._cut()  # the writer drops its reference once all are done
            while (index := next(self._claims)) < len(pieces):
                _copy_piece(pieces[index])
                with self._lock:
                    self._left -= 1
                    if self._left == 0:
                        self._pieces_done.set()
        except BaseException as e:
            self._failed = e
            self._pieces_done.set()
            raise

    def finish_copy(self) -> None:
        """Run in the writer: copy deferred CPU pieces and wait for CUDA copies; then release the fence.

        Raises if a piece failed, in this thread or in the training thread.
        """
        try:
            self.copy_pieces()
            for event in self.cuda_done:
                self.ops.synchronize(event)
            self._pieces_done.wait()  # the training thread may still be copying a piece it claimed
            if self._failed is not None:
                raise RuntimeError(f"a deferred snapshot copy failed: {self._failed}") from self._failed
        finally:
            self.deferred_cpu, self._pieces = [], []
            self.copied.set()

    def host_copy(self) -> tuple[int, float] | None:
        """(bytes, seconds) of the copies from the devices to the host, timed on their side streams (the
        slowest device's seconds), once they are done; None if there were none (never blocks)."""
        done = [(start, end, n) for start, end, n in self.host_copies if self.ops.query(end)]
        if not done or len(done) < len(self.host_copies):
            return None
        return sum(n for *_, n in done), max(self.ops.elapsed_s(start, end) for start, end, _ in done)

    def order_after_copy(self) -> None:
        """Make the current CUDA streams wait for the side-stream copies of the state (no CPU wait)."""
        for device, event in self.cuda_fence:
            stream = self.ops.current_stream(device)
            if self.waits is None:
                self.ops.wait_event(stream, event)
            else:
                self.waits.wait(stream, event, step=self.step, memory=self.memory, at="fence")


def _pieces(dst: torch.Tensor, src: torch.Tensor) -> list[CopyPiece]:
    """Split one deferred copy into pieces: address ranges for plain memory, else the pair itself.

    Address ranges are copied with ``ctypes.memmove``, which releases the GIL and runs on the
    calling thread only. The writer must not use ``Tensor.copy_``: ATen would start a second
    OpenMP team in the writer thread, which oversubscribes the cores that the training loop's
    team runs on and slows every later iteration, not only those the copy overlaps
    (docs/performance.md). Views that are not plain contiguous memory (strided, lazily
    conjugated or negated) are copied whole with ``copy_``.
    """
    if not (
        src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype and not (src.is_conj() or src.is_neg())
    ):
        return [(dst, src)]
    nbytes = src.numel() * src.element_size()
    d, s = dst.data_ptr(), src.data_ptr()
    return [
        (d + at, s + at, min(DEFERRED_COPY_PIECE_BYTES, nbytes - at))
        for at in range(0, nbytes, DEFERRED_COPY_PIECE_BYTES)
    ]


def _copy_piece(piece: CopyPiece) -> None:
    if len(piece) == 3:
        dst, src, size = piece
        ctypes.memmove(dst, src, size)
    else:
        with torch.no_grad():
            piece[0].copy_(piece[1])


class Snapshotter:
    """Owns the reusable host buffer, the side CUDA streams and the staging buffers.

    Args:
        gpu_staging: stage CUDA snapshots through device memory: ``None`` when the state fits in
            half of the device memory a training step leaves
            (:func:`~checkfreq.pipeline.capture.staging.choose_staging`), ``True``/``False`` always/never.
        ops: the device operations (CUDA's; a test's fake records their order on a CPU).
        registry: registers the host buffer of device copies (None: this process's, made when first needed).
    """

    def __init__(
        self, gpu_staging: bool | None = None, ops: DeviceOps = CUDA, registry: HostRegistry | None = None
    ) -> None:
        self._signature: tuple[object, ...] | None = None
        self._viewed: tuple[Layout, bool] | None = None
        """The layout and pinning the views were last handed out for (the same objects: no comparison)."""
        self._layouts: list[tuple[Specs, Layout]] = []
        self._buffer: torch.Tensor | None = None
        self._registered: RegisteredBuffer | None = None
        """The host buffer when device copies go to it: registered, given back at :meth:`close`."""
        self._registry = registry
        self._views: list[torch.Tensor] = []
        self._ops = ops
        self._streams: dict[torch.device, Any] = {}
        self._force_staging = gpu_staging
        self._staging: dict[torch.device, StagingBuffer | None] = {}
        self._staging_failed: set[torch.device] = set()
        self.stepped = False
        """A whole training step has run in this process (set by the saver): the staging choice can be made."""
        self.gpu_waits = GpuWaits(ops)
        """The training streams' waits on the side streams, timed on the GPU."""

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def is_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on a device: only this snapshotter's stream copies read it."""
        return self._ops.is_device(tensor)

    def staging_bytes(self, device: torch.device) -> int:
        """Bytes of ``device``'s staging buffer (0 without one)."""
        staging = self._staging.get(device)
        return 0 if staging is None else staging.nbytes

    def close(self) -> None:
        """Give back the host buffer and the staging buffers (every snapshot's copies must be done)."""
        self._release_buffer()
        self._signature, self._viewed = None, None
        for staging in self._staging.values():
            if staging is not None:
                staging.release()
        self._staging.clear()

    def layout_of(self, tensors: Mapping[str, torch.Tensor]) -> Layout:
        """Where each of ``tensors`` goes in a snapshot buffer: planned again only when a name, a dtype
        or a shape changed, so a session's snapshots share one layout (two kept: a checkpoint's, and a
        tier's share of the state)."""
        specs = _specs(tensors)
        for known, layout in self._layouts:
            if known == specs:
                return layout
        layout = plan_layout(specs)
        self._layouts = [(specs, layout), *self._layouts[:1]]
        return layout

    def _views_for(self, layout: Layout, pin: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        viewed = self._viewed
        if viewed is not None and viewed[0] is layout and viewed[1] == pin and self._buffer is not None:
            return self._buffer, self._views
        signature = (layout.signature, pin)
        if signature != self._signature or self._buffer is None:
            self._release_buffer()  # before allocating: the old one's copies and writes are done
            self._buffer = self._host_buffer(layout.nbytes) if pin else aligned_empty(layout.nbytes, pin=False)
            self._views = [slot_view(self._buffer, slot) for slot in layout.slots]
            self._signature = signature
        self._viewed = (layout, pin)
        return self._buffer, self._views

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer for device copies: registered (:class:`RegisteredBuffer`), else, if the
        platform refused, torch's pinned memory."""
        if self._registry is None:
            self._registry = host_registry()
        registered = RegisteredBuffer(nbytes, self._registry)
        if not registered.pinned:
            return aligned_empty(nbytes, pin=True)
        self._registered = registered
        return registered.tensor

    def _release_buffer(self) -> None:
        if self._registered is not None:
            self._registered.release()
            self._registered = None
        self._buffer, self._views = None, []

    def take(
        self,
        tensors: Mapping[str, torch.Tensor],
        deferred: Collection[str],
        *,
        layout: Layout | None = None,
        buffer: torch.Tensor | None = None,
        views: list[torch.Tensor] | None = None,
        step: int = 0,
        memory: bool = False,
        aside: Mapping[str, torch.Tensor] | None = None,
    ) -> PendingSnapshot:
        """Copy ``tensors`` into the host buffer; names in ``deferred`` may be copied later (fenced).

        ``buffer`` (``layout.nbytes`` bytes, e.g. a slot of the memory tier) replaces the
        snapshotter's own buffer for this snapshot; ``layout`` is ``layout_of(tensors)`` if the
        caller planned it already; ``views``, if given, are ``buffer``'s for ``layout`` (made once per
        slot by a memory tier). ``step`` and ``memory`` label the GPU waits it causes. The
        tensors of ``aside`` are copied too, into host memory of their own (:attr:`PendingSnapshot.aside`),
        as late as the deferred ones: the replica claim's device pieces, which only the writer reads.
        """
        layout = layout or self.layout_of(tensors)
        ops = self._ops
        pin = torch.cuda.is_available() and any(ops.is_device(t) for t in tensors.values())
        if buffer is None:
            buffer, views = self._views_for(layout, pin)
        elif views is None:
            views = [slot_view(buffer, slot) for slot in layout.slots]
        now_cpu: CopyPairs = []
        later_cpu: CopyPairs = []
        cuda_now: dict[torch.device, CopyPairs] = {}
        cuda_later: dict[torch.device, CopyPairs] = {}
        cuda_aside: dict[torch.device, CopyPairs] = {}
        for slot, view in zip(layout.slots, views, strict=True):
            src = tensors[slot.name]
            later = slot.name in deferred
            if ops.is_device(src):
                (cuda_later if later else cuda_now).setdefault(src.device, []).append((view, src))
            else:
                (later_cpu if later else now_cpu).append((view, src))
        copies = aside_buffers(aside or {}, pin)
        for name, src in (aside or {}).items():
            if ops.is_device(src):
                cuda_aside.setdefault(src.device, []).append((copies[name], src))
            else:
                now_cpu.append((copies[name], src))
        pending = PendingSnapshot(
            layout, buffer, later_cpu, waits=self.gpu_waits, step=step, memory=memory, ops=ops, aside=copies
        )
        for device in set(cuda_now) | set(cuda_later) | set(cuda_aside):
            fence, start, done, nbytes = self._copy_on_side_stream(
                device, cuda_now.get(device, []), cuda_later.get(device, []), cuda_aside.get(device, []), step, memory
            )
            pending.cuda_fence.append((device, fence))
            pending.cuda_done.append(done)
            pending.host_copies.append((start, done, nbytes))
        with torch.no_grad():
            for dst, src in now_cpu:
                dst.copy_(src)
        if not pending.has_deferred:
            pending.copied.set()
        return pending

    def _copy_on_side_stream(
        self, device: torch.device, now: CopyPairs, later: CopyPairs, aside: CopyPairs, step: int, memory: bool
    ) -> tuple[Any, Any, Any, int]:
        """Copy on ``device``'s side stream: ``now`` before the next forward, ``later`` and ``aside``
        before the next optimizer step (``aside`` straight to the host, never through the staging
        buffer: the replica claim's pieces change at every checkpoint, the buffer's layout must not).
        Returns the events (the state copied: the fence; the timed copy to the host begins; everything
        is on the host) and the bytes that timed copy moves."""
        ops = self._ops
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = ops.side_stream(device)
        current = ops.current_stream(device)
        ops.wait_stream(stream, current)
        pairs = now + later
        for _, src in pairs + aside:  # a source freed by the caller keeps its memory until the side stream read it
            ops.keep_alive(src, stream)
        staged = self._staged_views(device, pairs, stream) if pairs else None  # allocated for the side stream only
        first = pairs if staged is None else [(view, src) for view, (_, src) in zip(staged, pairs, strict=True)]
        start = ops.record(stream, timing=staged is None)
        ops.copy(stream, first[: len(now)])
        now_done = ops.record(stream) if now else None
        ops.copy(stream, first[len(now) :])
        ops.copy(stream, aside)
        fence = done = ops.record(stream, timing=staged is None)
        nbytes = sum(src.numel() * src.element_size() for _, src in pairs + ([] if staged is not None else aside))
        if staged is not None:  # the slow copy to the host, while the next steps compute
            start = ops.record(stream, timing=True)
            ops.copy(stream, [(dst, view) for view, (dst, _) in zip(staged, pairs, strict=True)])
            done = ops.record(stream, timing=True)
        if now_done is not None:  # the next forward runs only after forward-mutated tensors are copied
            self.gpu_waits.wait(current, now_done, step=step, memory=memory, at="snapshot")
        return fence, start, done, nbytes

    def _staged_views(self, device: torch.device, pairs: CopyPairs, stream: Any) -> list[torch.Tensor] | None:
        """The staging buffer's views for ``pairs``' sources, or None where this snapshot of ``device``
        goes straight to the host. The choice is made once a whole step has run, and again when the
        state outgrows the buffer (:mod:`checkfreq.pipeline.capture.staging`)."""
        sources = [src for _, src in pairs]
        staging = self._staging.get(device)
        if staging is not None and staging.fits(sources):
            return staging.views_for(sources, stream)
        if device in self._staging_failed or (self._force_staging is None and not self.stepped):
            return None  # before a whole step ran, the memory it needs is unknown: straight to the host
        if device not in self._staging or staging is not None:  # the first choice, or the state grew
            nbytes = sum(src.numel() * src.element_size() for src in sources)
            room = staging_room(*self._ops.memory(device), self.staging_bytes(device))
            choice = choose_staging(nbytes, room, self._force_staging)
            path = "GPU staging buffer" if choice.use else "direct copy to the host"
            log.info("snapshots of %s: %s: %s", device, path, choice.reason)
            if staging is not None:
                staging.release()  # stream order: its last copies are queued before any use of the new one
            self._staging[device] = StagingBuffer(device, self._ops) if choice.use else None
        staging = self._staging[device]
        if staging is None:
            return None
        try:
            return staging.views_for(sources, stream)
        except torch.cuda.OutOfMemoryError:
            nbytes = sum(src.numel() * src.element_size() for src in sources)
            log.warning(
                "snapshots of %s: no device memory left for the staging buffer (%.2f GB); copying straight "
                "to the host from now on",
                device,
                nbytes / 1e9,
            )
            staging.release()
            self._staging[device] = None
            self._staging_failed.add(device)
            return None


def layout_of(tensors: Mapping[str, torch.Tensor]) -> Layout:
    """Where each of ``tensors`` goes in a snapshot buffer."""
    return plan_layout(_specs(tensors))


def _specs(tensors: Mapping[str, torch.Tensor]) -> Specs:
    return {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}


def aside_buffers(tensors: Mapping[str, torch.Tensor], pin: bool) -> dict[str, torch.Tensor]:
    """A contiguous host tensor shaped like each of ``tensors``, all in one buffer (pinned with ``pin``)."""
    if not tensors:
        return {}
    offsets, total = [], 0
    for tensor in tensors.values():
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // 64) * 64  # every start aligned for any dtype
    flat = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
    return {
        name: flat[at : at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        for (name, t), at in zip(tensors.items(), offsets, strict=True)
    }


def aligned_empty(nbytes: int, pin: bool) -> torch.Tensor:
    """A flat ``uint8`` host buffer starting at a :data:`BLOCK_BYTES`-aligned address (for direct I/O)."""
    raw = torch.empty(nbytes + BLOCK_BYTES, dtype=torch.uint8, pin_memory=pin)
    start = -raw.data_ptr() % BLOCK_BYTES
    return raw[start : start + nbytes]
