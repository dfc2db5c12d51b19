"""The fence: before the state changes (an optimizer step pre-hook), wait for the deferred copies of
the newest snapshot, so that every tensor of a snapshot comes from one point between two steps."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from checkfreq.errors import PersistTimeoutError
from checkfreq.pipeline.capture.snapshot import PendingSnapshot
from checkfreq.pipeline.capture.writer import Writer


@dataclass(frozen=True)
class FenceWait:
    """What a fence cost the training thread."""

    wait_s: float
    """Seconds waited at the fence itself."""
    stall_s: float
    """The snapshot's whole stall: taking it, and the wait at its fence."""


Account = Callable[[FenceWait], None]
"""Who learns what a fence cost: the persist's profile, or the tier a snapshot was taken for alone."""


class Fence:
    """The snapshot whose deferred copies the next optimizer step must wait for, if any."""

    def __init__(self) -> None:
        self._pending: PendingSnapshot | None = None
        self._writer: Writer | None = None
        self._stall = 0.0
        self._account: Account | None = None

    def arm(self, pending: PendingSnapshot, writer: Writer, stall: float, account: Account) -> None:
        """The next optimizer step waits for ``pending``'s deferred copies, which ``writer``'s job finishes
        (``stall``: what taking the snapshot already cost; ``account`` is told what the fence cost)."""
        self._pending, self._writer, self._stall, self._account = pending, writer, stall, account

    def clear(self) -> None:
        self._pending = self._writer = self._account = None

    def finish(self, timeout: float) -> None:
        """Wait until the deferred CPU copies are done (the training thread copies the pieces the writer
        has not reached), then tell the snapshot's account what it cost; nothing if no snapshot was
        waiting. CUDA copies are never waited for on the CPU: the current stream waits on their
        events, even when CPU tensors (a non-fused optimizer's ``step``) were deferred beside them."""
        pending, writer, account = self._pending, self._writer, self._account
        self.clear()
        if pending is None or writer is None or account is None:
            return
        start = time.perf_counter()
        pending.order_after_copy()
        if pending.cpu_fence:
            pending.copy_pieces()  # share the copies the writer has not reached yet
            deadline = start + timeout
            while not pending.cpu_copied.wait(0.5):
                writer.check_alive()
                if time.perf_counter() > deadline:
                    raise PersistTimeoutError(f"snapshot copy still running after {timeout} s")
            writer.check_alive()  # a dead writer, whose pieces this thread copied, is said here
        wait = time.perf_counter() - start
        account(FenceWait(wait, self._stall + wait))
