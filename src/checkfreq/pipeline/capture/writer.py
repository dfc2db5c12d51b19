"""Phase 2: one background writer thread, at most one checkpoint in flight.

A thread rather than a process: the writer's work is ``pwrite``/``fsync`` straight from the
host buffer (direct I/O; both release the GIL) plus an xxh3 checksum at >10 GB/s, so it holds
the GIL for very little time, and a thread shares the host buffer without shared-memory
plumbing. See docs/architecture.md for the measurement behind this choice.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from checkfreq.errors import PersistError, PersistTimeoutError

log = logging.getLogger("checkfreq.persist")

POLL_SECONDS = 0.5


class Writer:
    """Runs persist jobs one at a time in a daemon thread; keeps their results and the first error
    for the training thread, which applies them (a job never calls back into its submitter)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._results: list[Any] = []
        self.transitions = 0
        """Jobs submitted plus jobs finished: a change between two looks means a job ran in between."""
        self._thread = threading.Thread(target=self._run, name="checkfreq-writer", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def submit(self, job: Callable[[], Any]) -> None:
        """Queue ``job``; the caller must have waited for the previous one."""
        if self.busy:
            raise RuntimeError("a persist is already in flight")
        self.check_alive()
        self._idle.clear()
        self.transitions += 1
        self._jobs.put(job)

    def wait(self, timeout: float | None = None) -> None:
        """Block until no job is in flight; raise if the thread died or ``timeout`` passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._idle.wait(POLL_SECONDS):
            self.check_alive()
            if deadline is not None and time.monotonic() > deadline:
                raise PersistTimeoutError(f"checkpoint persist still running after {timeout} s")

    def drain(self, timeout: float | None = None) -> tuple[list[Any], BaseException | None]:
        """Wait for the job in flight (:meth:`wait`), then take what the jobs returned and the error, if any."""
        self.wait(timeout)
        return self.take_results(), self.take_error()

    def take_results(self) -> list[Any]:
        """What the jobs finished since the last call returned (None results are left out), in order."""
        results, self._results = self._results, []
        return results

    def take_error(self) -> BaseException | None:
        """The error of a failed job, or of a thread that died with a job in flight (cleared by this call)."""
        error, self._error = self._error, None
        if error is None and not self._idle.is_set() and not self._thread.is_alive():
            self._idle.set()
            error = PersistError("the checkpoint writer thread died with a checkpoint in flight")
        return error

    def close(self, timeout: float | None = None) -> None:
        """Finish the job in flight and stop the thread."""
        if self._thread.is_alive():
            self.wait(timeout)
            self._jobs.put(None)
            self._thread.join(timeout)

    def check_alive(self) -> None:
        """Raise :class:`PersistError` if the writer thread has died."""
        if not self._thread.is_alive():
            self._idle.set()
            raise PersistError("the checkpoint writer thread is gone")

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                result = job()
                if result is not None:
                    self._results.append(result)
            except BaseException as e:  # noqa: BLE001 - reported to the training thread
                self._error = e
            finally:
                self.transitions += 1
                self._idle.set()
