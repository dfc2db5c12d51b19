"""How far the memory tier's copies on other machines (``replicas=``) lag its snapshots, from every
rank's events: the seconds from a snapshot to its copy kept, the snapshots its rank took meanwhile,
and the newest step every rank's copy had reached at the end of the log (where a node lost then
resumes from, at best)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CopyLag:
    """The lag of the copies kept, over every rank's (``replica`` events of copies kept, ``memory``
    events of the snapshots)."""

    median_s: float
    max_s: float
    median_snapshots: float
    """The snapshots a rank took between one of its snapshots and that snapshot's copy landing."""
    max_snapshots: int
    newest_step: int
    """The newest snapshot of any rank."""
    reached_step: int | None
    """The newest step every rank's copy had reached at the end (None: some rank had none kept)."""
    without_copy: list[int] = field(default_factory=list)
    """The ranks with snapshots but no copy kept."""


def copy_lag(events: Iterable[dict[str, Any]]) -> CopyLag | None:
    """The lag of the copies kept, from every rank's events; None where no copy was kept."""
    taken: dict[int, dict[int, float]] = {}
    kept: list[tuple[int, int, float]] = []
    for e in events:
        rank, step, when = e.get("rank", 0), e.get("step"), e.get("time")
        if not isinstance(step, int) or not isinstance(when, (int, float)):
            continue
        if e.get("event") == "memory":
            taken.setdefault(rank, {})[step] = float(when)
        elif e.get("event") == "replica" and e.get("kept"):
            kept.append((rank, step, float(when)))
    seconds: list[float] = []
    behind: list[int] = []
    reached: dict[int, int] = {}
    for rank, step, landed in kept:
        snapped = taken.get(rank, {}).get(step)
        if snapped is None:
            continue
        seconds.append(landed - snapped)
        behind.append(sum(1 for t in taken[rank].values() if snapped < t <= landed))
        reached[rank] = max(reached.get(rank, step), step)
    if not seconds:
        return None
    without = sorted(rank for rank in taken if rank not in reached)
    return CopyLag(
        median_s=statistics.median(seconds),
        max_s=max(seconds),
        median_snapshots=statistics.median(behind),
        max_snapshots=max(behind),
        newest_step=max(step for steps in taken.values() for step in steps),
        reached_step=None if without else min(reached.values()),
        without_copy=without,
    )
