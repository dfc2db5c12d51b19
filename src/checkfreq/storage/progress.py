"""Progress of long reads: the data-file readers report each chunk they verify to whoever watches
(a command line's progress bar, the restore's log), so that reading many gigabytes shows; both
watch reads of :func:`progress_bytes` (1 GB) or more.

One watcher at a time per process (the last one started, until it ends), called from whichever
thread reads; a watcher must be cheap and thread-safe.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PROGRESS_BYTES = 1_000_000_000
"""From how many bytes to read progress is shown (the command line's bar) or logged (a restore)."""
PROGRESS_BYTES_ENV = "CHECKFREQ_PROGRESS_BYTES"
"""The environment variable that sets another threshold, in bytes."""

Watcher = Callable[[int], None]
"""Called with the bytes of each chunk read and verified."""

_lock = threading.Lock()
_watcher: Watcher | None = None


@contextmanager
def watching_reads(watcher: Watcher) -> Iterator[None]:
    """Call ``watcher`` with the size of every chunk a data file reader verifies until this ends."""
    global _watcher
    with _lock:
        previous, _watcher = _watcher, watcher
    try:
        yield
    finally:
        with _lock:
            _watcher = previous


def chunk_read(nbytes: int) -> None:
    """Tell the watcher, if any, that ``nbytes`` more were read and verified."""
    watcher = _watcher
    if watcher is not None:
        watcher(nbytes)


def progress_bytes() -> int:
    """The threshold in force: :data:`PROGRESS_BYTES_ENV` if set to a whole number of bytes, else
    :data:`PROGRESS_BYTES`."""
    try:
        return int(os.environ[PROGRESS_BYTES_ENV])
    except (KeyError, ValueError):
        return PROGRESS_BYTES
