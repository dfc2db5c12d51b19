"""A CPU stand-in for a GPU's streams, events and caching allocator, for the snapshot's ordering logic.

:class:`FakeDevice` has the methods of :class:`~checkfreq.pipeline.capture.device_ops.DeviceOps`. What makes it
a device and not a plain CPU:

* "device" tensors live in one pool of host memory handed out by a caching allocator: a tensor's
  block goes back to the allocator when the tensor's last view dies, and the next allocation of
  that size gets the same block at once (as CUDA's caching allocator does on one stream), unless
  :meth:`keep_alive` (``record_stream``) put it off until the streams' queued work has run;
* work on a stream is queued, not done: copies hold addresses, not tensors (a kernel reads what
  is at the address when it runs), and nothing runs until :meth:`run` (or, with ``auto``, a
  :meth:`synchronize` that needs it); :meth:`run` takes the training stream first, as a slow side
  stream would let it;
* a copy into a host range that was registered when it was queued and is unregistered when it runs
  is recorded as a violation (:attr:`violations`), as is a wait or a copy after the fact.

Everything that ran is in :attr:`log`, in order.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from checkfreq.storage.host_pinning import RecordingRegistry

ALIGN = 256


@dataclass(eq=False)
class FakeEvent:
    name: str
    timing: bool = False
    done: bool = False
    at: int = 0


@dataclass(eq=False)
class FakeStream:
    name: str
    queue: list[tuple[str, Any]] = field(default_factory=list)
    ran: int = 0  # ops of the queue done

    def __repr__(self) -> str:
        return self.name


class FakeRegistry(RecordingRegistry):
    """Books of registered host ranges that the fake device checks its copies against; with
    ``pinned_seen`` False, the device does not see them pinned (a registration that did not take)."""

    pinned_seen = True

    def seen_pinned(self, tensor: torch.Tensor) -> bool:
        return self.pinned_seen


class FakeDevice:
    """See the module docstring. ``auto``: a :meth:`synchronize` runs the streams itself."""

    def __init__(self, pool_bytes: int = 64 << 20, *, auto: bool = True) -> None:
        self._pool = bytearray(pool_bytes)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._pool))
        self._bump = 0
        self._free: dict[int, list[int]] = {}  # size -> offsets, newest last
        self._blocks: dict[int, int] = {}  # offset -> size, allocated
        self._recorded: dict[int, set[FakeStream]] = {}  # offset -> streams it was used on
        self._deferred: list[tuple[int, int, dict[FakeStream, int]]] = []
        self._lock = threading.RLock()
        self._ran = threading.Condition(self._lock)
        self._clock = 0
        self.auto = auto
        self.training = FakeStream("training")
        self.streams = [self.training]
        self.log: list[tuple[str, ...]] = []
        self.violations: list[str] = []
        self.registry = FakeRegistry()
        self.memory_figures = (1 << 40, 0, 0)
        self.refuse_empty = False
        self.device = torch.device("cpu")

    # -------------------------------------------------------------- the allocator

    def alloc(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A device tensor (uninitialised) from the caching allocator."""
        nbytes = max(1, torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        size = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            free = self._free.get(size)
            if free:
                offset = free.pop()
            else:
                offset, self._bump = self._bump, self._bump + size
                assert self._bump <= len(self._pool), "fake device out of memory"
            self._blocks[offset] = size
        raw = (ctypes.c_uint8 * size).from_buffer(self._pool, offset)
        weakref.finalize(raw, self._freed, offset)
        flat = torch.frombuffer(raw, dtype=torch.uint8)[:nbytes]
        return flat.view(dtype)[: torch.Size(shape).numel()].view(tuple(shape))

    def tensor(self, values: torch.Tensor) -> torch.Tensor:
        """A device tensor holding ``values`` (as if a kernel that already ran wrote them)."""
        out = self.alloc(values.shape, values.dtype)
        out.copy_(values)
        return out

    def _offset_of(self, address: int) -> int | None:
        at = address - self._base
        if not 0 <= at < len(self._pool):
            return None
        for offset, size in self._blocks.items():
            if offset <= at < offset + size:
                return offset
        return None

    def _freed(self, offset: int) -> None:
        with self._lock:
            size = self._blocks.pop(offset)
            streams = self._recorded.pop(offset, set())
            pending = {s: len(s.queue) for s in streams if s.ran < len(s.queue)}
            if pending:
                self._deferred.append((offset, size, pending))
            else:
                self._free.setdefault(size, []).append(offset)
            self.log.append(("free", hex(offset), str(sorted(map(str, pending)))))

    def _release_deferred(self) -> None:
        still = []
        for offset, size, pending in self._deferred:
            if all(s.ran >= n for s, n in pending.items()):
                self._free.setdefault(size, []).append(offset)
            else:
                still.append((offset, size, pending))
        self._deferred = still

    # -------------------------------------------------------------- DeviceOps

    def is_device(self, tensor: torch.Tensor) -> bool:
        return 0 <= tensor.data_ptr() - self._base < len(self._pool)

    def side_stream(self, device: torch.device) -> FakeStream:
        stream = FakeStream(f"side{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.training

    def wait_stream(self, stream: FakeStream, other: FakeStream) -> None:
        self.wait_event(stream, self.record(other))

    def record(self, stream: FakeStream, *, timing: bool = False) -> FakeEvent:
        event = FakeEvent(f"{stream.name}#{len(stream.queue)}", timing)
        with self._lock:
            stream.queue.append(("record", event))
        return event

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        with self._lock:
            stream.queue.append(("wait", event))

    def copy(self, stream: FakeStream, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with self._lock:
            for dst, src in pairs:
                assert dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype
                nbytes = src.numel() * src.element_size()
                registered = self._registered(dst.data_ptr())
                stream.queue.append(("copy", (dst.data_ptr(), src.data_ptr(), nbytes, registered)))

    def keep_alive(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        offset = self._offset_of(tensor.data_ptr())
        if offset is not None:
            with self._lock:
                self._recorded.setdefault(offset, set()).add(stream)

    def synchronize(self, event: FakeEvent) -> None:
        with self._ran:
            if self.auto:
                self.run()
            while not event.done:
                self._ran.wait()
        self.log.append(("synchronized", event.name))

    def query(self, event: FakeEvent) -> bool:
        return event.done

    def elapsed_s(self, before: FakeEvent, after: FakeEvent) -> float:
        assert before.timing and after.timing and before.done and after.done
        return (after.at - before.at) / 1000.0

    def empty(self, nbytes: int, device: torch.device, stream: Any) -> torch.Tensor:
        if self.refuse_empty:
            raise torch.cuda.OutOfMemoryError("fake device: no room for the staging buffer")
        return self.alloc((nbytes,), torch.uint8)

    def memory(self, device: torch.device) -> tuple[int, int, int]:
        return self.memory_figures

    # -------------------------------------------------------------- the "GPU"

    def launch(self, stream: FakeStream, kernel: Callable[[], None], name: str = "kernel") -> None:
        """Queue a kernel (a Python function run when the stream reaches it)."""
        with self._lock:
            stream.queue.append(("kernel", (kernel, name)))

    def waits_on(self, stream: FakeStream) -> list[str]:
        """The events ``stream`` was told to wait for, in order."""
        return [op[1].name for op in stream.queue if op[0] == "wait"]

    def run(self) -> None:
        """Run every stream as far as its waits allow, the training stream first each round."""
        with self._ran:
            progress = True
            while progress:
                progress = False
                for stream in self.streams:
                    while stream.ran < len(stream.queue):
                        kind, arg = stream.queue[stream.ran]
                        if kind == "wait" and not arg.done:
                            break
                        self._execute(stream, kind, arg)
                        stream.ran += 1
                        progress = True
                self._release_deferred()
            self._ran.notify_all()

    def _execute(self, stream: FakeStream, kind: str, arg: Any) -> None:
        self._clock += 1
        if kind == "record":
            arg.done, arg.at = True, self._clock
        elif kind == "kernel":
            arg[0]()
            self.log.append(("kernel", stream.name, arg[1]))
        elif kind == "copy":
            dst, src, nbytes, registered = arg
            if registered and not self._registered(dst):
                self.violations.append(f"{stream.name}: copy into {dst:#x} after its range was unregistered")
            ctypes.memmove(dst, src, nbytes)
            self.log.append(("copy", stream.name, hex(dst), hex(src)))

    def _registered(self, address: int) -> bool:
        return any(start <= address < start + n for start, n in self.registry.registered().items())
