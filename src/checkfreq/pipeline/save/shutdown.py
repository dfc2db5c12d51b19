"""A Checkpointer's end when it was not closed: at the interpreter's exit, when it is dropped, or when
its ``with`` block ends on an error.

Under torch.distributed, a process that leaves on an error (its training thread raised, a peer was
lost) must end promptly, so that torchrun restarts the job: it waits for its writer and the remote tier's upload at
most the failure timeout in all, then tells the other ranks that it leaves (their waits on it end at
once, :meth:`~checkfreq.ranks.cluster.Cluster.leave`), naming the rank lost if its error was a lost
peer's. A checkpoint still being committed then stays uncommitted, as after a kill: the
next start clears it, and every committed checkpoint is whole. A process that leaves without an
error waits for the checkpoint in flight as :meth:`~checkfreq.Checkpointer.close` does.
"""

from __future__ import annotations

import logging
import sys
import time

from checkfreq.errors import CheckfreqError
from checkfreq.pipeline.capture.writer import Writer
from checkfreq.pipeline.tiers.chosen import Tiers
from checkfreq.ranks.cluster import Cluster
from checkfreq.run.signals import SignalTrap

log = logging.getLogger("checkfreq.persist")


def shutdown(
    writer: Writer,
    tiers: Tiers,
    *,
    timeout: float,
    failure_timeout: float,
    trap: SignalTrap | None,
    cluster: Cluster,
    leaving: list[BaseException] | None = None,
) -> None:
    """Stop the writer and the tiers' copies in flight, give the groups back and unlock the tiers.

    ``timeout`` bounds the waits for storage (``persist_timeout``). Where other ranks are, a process
    leaving on an error (``leaving``, else :func:`leaving_on_error`) or in a job that failed waits
    at most ``failure_timeout`` in all, then tells the other ranks it leaves
    (:meth:`~checkfreq.ranks.cluster.Cluster.leave`) and leaves the groups to the process's exit (a
    thread may still be blocked in one).
    """
    error = leaving[0] if leaving else leaving_on_error()
    failing = cluster.others_wait and (error is not None or cluster.failure is not None)
    deadline = time.monotonic() + failure_timeout
    try:
        if trap is not None:
            trap.uninstall()
        try:
            writer.close(failure_timeout if failing else timeout)
            tiers.stop(max(0.0, deadline - time.monotonic()) if failing else timeout)
        except CheckfreqError as e:
            if not failing:
                raise
            log.warning("leaving without the checkpoint in flight, which stays uncommitted: %s", e)
        if not failing:
            cluster.release()
        elif error is not None:
            cluster.leave(error, max(0.0, deadline - time.monotonic()))
    finally:
        tiers.release()


def leaving_on_error() -> BaseException | None:
    """The error this process is leaving on: the one that ended the main script (Python keeps it
    for the exit's callbacks), else None."""
    error = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return error if isinstance(error, BaseException) else None
