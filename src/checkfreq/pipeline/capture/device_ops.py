"""The CUDA calls a snapshot makes, behind one small interface, so that their order can be checked on a CPU.

A snapshot of CUDA state is a sequence of stream operations: the side stream waits for the training
stream, copies (device to device into the staging buffer, device to host into a pinned buffer or a
registered memory slot), records events; the training stream waits for some of those events; the
writer thread waits on the CPU for the last one. Whether that sequence is right is a matter of
order: a source read after its memory was handed to the next forward, a wait placed before the copy
it should follow, a host range unregistered under a copy still writing into it. :class:`CudaOps`
makes the calls; a test gives the snapshotter a fake with the same methods that runs the streams
when told to and records what happened in which order (tests/fake_device.py).

Streams and events are opaque to the callers (``Any``): a fake's are its own objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from checkfreq.run.tensors import local_part

Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]
"""``(dst, src)`` copies."""


class DeviceOps(Protocol):
    """Streams, events, copies and the caching allocator, as a snapshot uses them."""

    def is_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on an accelerator (its copies go through streams)."""
        ...

    def side_stream(self, device: torch.device) -> Any:
        """A new stream on ``device`` for the snapshot's copies."""
        ...

    def current_stream(self, device: torch.device) -> Any:
        """The stream training runs on."""
        ...

    def wait_stream(self, stream: Any, other: Any) -> None:
        """Work queued on ``stream`` from now on runs after the work queued on ``other`` so far."""
        ...

    def record(self, stream: Any, *, timing: bool = False) -> Any:
        """An event recorded on ``stream`` now (with ``timing``, one that :meth:`elapsed_s` can read)."""
        ...

    def wait_event(self, stream: Any, event: Any) -> None:
        """Work queued on ``stream`` from now on runs after ``event``."""
        ...

    def copy(self, stream: Any, pairs: Pairs) -> None:
        """Queue ``dst.copy_(src)`` for each pair on ``stream``, without blocking the CPU."""
        ...

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """The memory of ``tensor`` is not handed to another tensor before the work queued on
        ``stream`` so far is done, even if ``tensor`` is freed first (``record_stream``)."""
        ...

    def synchronize(self, event: Any) -> None:
        """Block the calling thread until ``event`` has passed."""
        ...

    def query(self, event: Any) -> bool:
        """Whether ``event`` has passed (never blocks)."""
        ...

    def elapsed_s(self, before: Any, after: Any) -> float:
        """Seconds between two timing events that have passed."""
        ...

    def empty(self, nbytes: int, device: torch.device, stream: Any) -> torch.Tensor:
        """``nbytes`` of uninitialised device memory, to be used on ``stream`` only."""
        ...

    def memory(self, device: torch.device) -> tuple[int, int, int]:
        """(bytes free on ``device``, bytes the caching allocator holds, peak bytes allocated so far):
        what decides whether a staging buffer fits (:func:`~checkfreq.pipeline.capture.staging.staging_room`)."""
        ...


class CudaOps:
    """:class:`DeviceOps` on CUDA (torch.cuda)."""

    def is_device(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def side_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def record(self, stream: Any, *, timing: bool = False) -> Any:
        event = torch.cuda.Event(enable_timing=timing)
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def copy(self, stream: Any, pairs: Pairs) -> None:
        with torch.no_grad(), torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        local_part(tensor).record_stream(stream)  # a DTensor's memory is its local shard's

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def elapsed_s(self, before: Any, after: Any) -> float:
        return float(before.elapsed_time(after)) / 1000.0

    def empty(self, nbytes: int, device: torch.device, stream: Any) -> torch.Tensor:
        with torch.cuda.stream(stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def memory(self, device: torch.device) -> tuple[int, int, int]:
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), int(torch.cuda.memory_reserved(device)), int(torch.cuda.max_memory_allocated(device))


CUDA = CudaOps()
"""The real device operations (one per process: they hold no state)."""
