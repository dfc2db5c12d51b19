"""The restore's progress in the log: a rank that reads and verifies at least
:func:`~checkfreq.storage.progress.progress_bytes` (1 GB) logs at INFO as it goes, every tenth of
the way, so a restore of many gigabytes is not minutes of silence."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from checkfreq.storage.format import checkpoint_name
from checkfreq.storage.progress import progress_bytes, watching_reads

log = logging.getLogger("checkfreq.restore")

STEPS = 10
"""How many progress lines a long read logs (one each tenth)."""


class _ReadLog:
    """Counts the bytes read and logs each tenth of ``total`` reached."""

    def __init__(self, name: str, total: int) -> None:
        self.name, self.total = name, total
        self.done, self.logged = 0, 0
        self.start = time.monotonic()
        self._lock = threading.Lock()

    def __call__(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            tenth = min(STEPS, self.done * STEPS // self.total)
            if tenth <= self.logged:
                return
            self.logged = tenth
            seconds = max(time.monotonic() - self.start, 1e-9)
        log.info(
            "restore of %s: %.2f of %.2f GB read and verified (%d %%, %.0f MB/s)",
            self.name,
            self.done / 1e9,
            self.total / 1e9,
            100 * self.done // self.total,
            self.done / seconds / 1e6,
        )


@contextmanager
def logged_reads(step: int, total: int) -> Iterator[None]:
    """Log the progress of reading ``total`` bytes of checkpoint ``step`` while the block runs, if
    ``total`` is at least the threshold."""
    if total < max(progress_bytes(), 1):
        yield
        return
    name = checkpoint_name(step)
    log.info("restore of %s: reading and verifying %.2f GB", name, total / 1e9)
    with watching_reads(_ReadLog(name, total)):
        yield
