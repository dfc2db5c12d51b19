"""Where the ranks listed on this machine would resume from memory, and how far that lags its newest
snapshot: what ``checkfreq ls`` says of the copies kept here for other machines (``replicas=``)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from checkfreq.tools.catalog import CheckpointStatus

_NAME = re.compile(r"memory (rank|copy of rank) (\d+) slot \d+")


@dataclass(frozen=True)
class MemoryCut:
    """The newest step held by every rank listed here, in its own slots or as a copy kept here."""

    own_ranks: list[int]
    copied_ranks: list[int]
    """The ranks of other machines whose copies this machine keeps."""
    newest_step: int
    """The newest snapshot of this machine's own ranks."""
    resume_step: int | None
    """The newest step every listed rank holds whole (None: none): where the ranks of the other
    machines resume from memory if those machines are lost now, at best."""
    lag_s: float | None
    """Seconds from the snapshot of ``resume_step`` to the newest one (None: not known)."""

    @property
    def lag_steps(self) -> int | None:
        return None if self.resume_step is None else self.newest_step - self.resume_step

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "lag_steps": self.lag_steps}


def memory_cut(statuses: list[CheckpointStatus]) -> MemoryCut | None:
    """The cut of the memory snapshots among ``statuses`` (as :func:`~checkfreq.tools.catalog.memory_snapshots`
    lists them), or None where this machine keeps no copy or holds no snapshot of its own."""
    held: dict[tuple[str, int], dict[int, CheckpointStatus]] = {}
    for status in statuses:
        match = _NAME.fullmatch(status.name) if status.tier == "memory" and status.valid else None
        if match is not None:
            held.setdefault((match[1], int(match[2])), {})[status.step] = status
    own = sorted(rank for kind, rank in held if kind == "rank")
    copied = sorted(rank for kind, rank in held if kind != "rank")
    if not own or not copied:
        return None
    mine = [held["rank", rank] for rank in own]
    newest = max(step for steps in mine for step in steps)
    common = set.intersection(*(set(steps) for steps in held.values()))
    resume = max(common, default=None)
    return MemoryCut(own, copied, newest, resume, None if resume is None else _seconds_between(mine, resume, newest))


def _seconds_between(mine: list[dict[int, CheckpointStatus]], older: int, newer: int) -> float | None:
    """The longest time between a rank's snapshots of steps ``older`` and ``newer`` (None: not known)."""
    seconds = []
    for steps in mine:
        first, last = steps.get(older), steps.get(newer)
        if first is not None and last is not None and first.created is not None and last.created is not None:
            seconds.append(last.created - first.created)
    return max(seconds, default=None)
