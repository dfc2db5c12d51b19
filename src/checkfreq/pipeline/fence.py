"""The fence: before the state changes (an optimizer step pre-hook), wait for the deferred copies of
the newest snapshot, so that every tensor of a snapshot comes from one point between two steps."""

from __future__ import annotations

import time
from dataclasses import dataclass

from checkfreq.errors import PersistTimeoutError
from checkfreq.pipeline.snapshot import PendingSnapshot
from checkfreq.pipeline.writer import Writer


@dataclass(frozen=True)
class FenceWait:
    """What a fence cost the training thread."""

    wait_s: float
    """Seconds waited at the fence itself."""
    stall_s: float
    """The snapshot's whole stall: taking it, and the wait at its fence."""
    memory: bool
    """The snapshot was a memory-only one."""


class Fence:
    """The snapshot whose deferred copies the next optimizer step must wait for, if any."""

    def __init__(self) -> None:
        self._pending: PendingSnapshot | None = None
        self._writer: Writer | None = None
        self._stall = 0.0
        self._memory = False

    def arm(self, pending: PendingSnapshot, writer: Writer, stall: float, *, memory: bool) -> None:
        """The next optimizer step waits for ``pending``'s deferred copies, which ``writer``'s job finishes
        (``stall``: what taking the snapshot already cost)."""
        self._pending, self._writer, self._stall, self._memory = pending, writer, stall, memory

    def clear(self) -> None:
        self._pending = self._writer = None

    def finish(self, timeout: float) -> FenceWait | None:
        """Wait until the deferred copies are done (the training thread copies the pieces the writer
        has not reached); None if no snapshot was waiting. On CUDA the current stream only waits
        on the copies' events (no CPU block)."""
        pending, writer = self._pending, self._writer
        self.clear()
        if pending is None or writer is None:
            return None
        start = time.perf_counter()
        pending.order_after_copy()
        if pending.cpu_fence:
            pending.copy_pieces()  # share the copies the writer has not reached yet
            deadline = start + timeout
            while not pending.copied.wait(0.5):
                writer.check_alive()
                if time.perf_counter() > deadline:
                    raise PersistTimeoutError(f"snapshot copy still running after {timeout} s")
        wait = time.perf_counter() - start
        return FenceWait(wait, self._stall + wait, self._memory)
