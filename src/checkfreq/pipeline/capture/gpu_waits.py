"""What a snapshot costs the GPU: how long the training's CUDA stream waited on the snapshot's copies.

On a GPU the fence does not block the CPU: the training stream is told to wait for the copy's
event (``wait_event``) and the CPU goes on. The step is longer by however long the stream waited,
and a stall measured on the CPU misses it (0.011 s recorded for a snapshot whose step took 0.28 s
longer on an H100). So each such wait is bracketed by two timing events recorded on the training
stream; once the GPU has passed the second, ``elapsed_time`` between them is the wait, and it is
added to the snapshot's costs (the ``gpu_wait`` event, the profiler's stall, the memory cadence).

Reading the events never blocks: :meth:`GpuWaits.collect` returns the waits the GPU is done with.
Without CUDA nothing is ever recorded, and the measured stall is the CPU's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from checkfreq.pipeline.capture.device_ops import CUDA, DeviceOps


@dataclass(frozen=True)
class GpuWait:
    """One wait of the training stream on a snapshot's copy."""

    step: int
    memory: bool
    """The snapshot was a memory-only one."""
    at: str
    """``"snapshot"`` (the next forward waits for the tensors it may change) or ``"fence"``."""
    seconds: float


class GpuWaits:
    """Bracketed waits of training streams, until the GPU has passed them."""

    def __init__(self, ops: DeviceOps = CUDA) -> None:
        self._ops = ops
        self._open: list[tuple[int, bool, str, Any, Any]] = []

    def wait(self, stream: Any, event: Any, *, step: int, memory: bool, at: str) -> None:
        """Make ``stream`` wait for ``event``, timing the wait on the GPU."""
        before = self._ops.record(stream, timing=True)
        self._ops.wait_event(stream, event)
        after = self._ops.record(stream, timing=True)
        self._open.append((step, memory, at, before, after))

    def collect(self) -> list[GpuWait]:
        """The waits the GPU has passed since the last call (never blocks)."""
        done, still = [], []
        for entry in self._open:
            step, memory, at, before, after = entry
            if self._ops.query(after):
                done.append(GpuWait(step, memory, at, self._ops.elapsed_s(before, after)))
            else:
                still.append(entry)
        self._open = still
        return done
