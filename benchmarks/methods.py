"""One way of checkpointing a state, measured one repetition at a time.

A :class:`Method` is set up once per state, warmed up, then run repeatedly, interleaved with the
other methods. Each run returns a :class:`Sample`: how long the caller was blocked (the stall)
and, for methods that write, how long until the bytes were durable.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from benchmarks.states import State


@dataclass
class Sample:
    """One repetition. Seconds; NaN where the quantity does not apply."""

    stall: float
    durable: float = math.nan
    nbytes: int = 0
    """Bytes written or read (0: the state's size)."""
    write: float = math.nan
    """Seconds spent writing after the snapshot was taken (two-phase methods)."""


class Method:
    """Base of the measured methods: ``setup`` once, ``run`` per repetition, ``close`` at the end."""

    name = "method"
    kind = "baseline"
    """``limit``, ``baseline`` or ``checkfreq``."""

    def setup(self, state: State, workdir: Path) -> None:
        raise NotImplementedError

    def run(self) -> Sample:
        raise NotImplementedError

    def close(self) -> None:
        """Release files and workers (not timed)."""


def unlink(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        os.unlink(path)
