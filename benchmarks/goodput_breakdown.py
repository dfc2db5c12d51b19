"""What each failure of a goodput run cost, read from the job's marks (``benchmarks/goodput_job.py``)
and the driver's kills: pure functions, no I/O but reading the marks.

For a kill at time *k*, the next start of the job is the first mark ``start`` after *k* of each rank.
The breakdown takes, for each phase, the slowest rank (the job waits for it):

* ``detect``: from the kill to the first survivor's error (a rank's ``failed`` mark); none where no
  survivor said anything before its agent stopped it;
* ``restart``: from there (or the kill) to the slowest rank's new ``start``: the survivors' exit,
  torchrun's restart of the workers and its rendezvous;
* ``imports``, ``group`` (the process group), ``model`` (what the user's script builds), ``setup``
  (the variant's checkpointer made: for checkfreq, its groups and tiers), ``restore``;
* ``replay``: the steps trained again, from the step the restore took back to the newest step before
  the kill, at the fault-free step time.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PHASES = ("detect", "restart", "imports", "group", "model", "setup", "restore", "replay")
"""The parts of a failure's cost, in order."""


@dataclass(frozen=True)
class Failure:
    """One kill and what it cost."""

    kind: str
    """``rank`` (one worker SIGKILLed) or ``node`` (an agent and its workers, its memory wiped, replaced)."""
    at: float
    step_at_kill: int
    restored: int | None
    """The step the next start restored (None: the job did not start again)."""
    seconds: dict[str, float]
    """Each of :data:`PHASES` that was seen, in seconds."""
    back_s: float | None
    """From the kill to the first step trained after the restore."""

    @property
    def replayed(self) -> int | None:
        return None if self.restored is None else max(0, self.step_at_kill - self.restored)

    @property
    def cost_s(self) -> float | None:
        """What the failure cost in all: back in training, plus the steps trained again."""
        return None if self.back_s is None else self.back_s + self.seconds.get("replay", 0.0)


def read_marks(directory: Path) -> list[dict[str, Any]]:
    """Every rank's marks, in time order."""
    marks = [
        json.loads(line) for path in sorted(directory.glob("rank*.jsonl")) for line in path.read_text().splitlines()
    ]
    return sorted(marks, key=lambda m: m["t"])


def step_seconds(marks: Sequence[dict[str, Any]]) -> float:
    """The median time between two consecutive steps of rank 0 in one start (a fault-free step)."""
    steps = [m for m in marks if m["phase"] == "step"]
    gaps = sorted(b["t"] - a["t"] for a, b in zip(steps, steps[1:], strict=False) if b["step"] == a["step"] + 1)
    return gaps[len(gaps) // 2] if gaps else float("nan")


def failures(marks: Sequence[dict[str, Any]], kills: Sequence[dict[str, Any]], step_s: float) -> list[Failure]:
    """Each kill of ``kills`` (``{"t", "kind"}``) with what it cost, from the job's ``marks``."""
    found = []
    ends = [k["t"] for k in kills[1:]] + [float("inf")] * bool(kills)
    for kill, until in zip(kills, ends, strict=True):
        at = kill["t"]
        before = [m["step"] for m in marks if m["phase"] == "step" and m["t"] < at]
        after = [m for m in marks if at < m["t"] < until]
        found.append(_failure(kill["kind"], at, before[-1] if before else 0, after, step_s))
    return found


def _failure(kind: str, at: float, step: int, after: list[dict[str, Any]], step_s: float) -> Failure:
    starts = {m["rank"]: m for m in reversed(after) if m["phase"] == "start"}  # each rank's first, kept last
    firsts: dict[str, float] = {}
    for phase, _ in _NAMES:
        times = [_first(after, rank, phase, start["t"]) for rank, start in starts.items()]
        if times and all(t is not None for t in times):
            firsts[phase] = max(t for t in times if t is not None)
    restored = next((m["step"] for m in after if m["phase"] == "restored"), None)
    failed = next((m["t"] for m in after if m["phase"] == "failed"), None)
    seconds: dict[str, float] = {}
    if failed is not None:
        seconds["detect"] = failed - at
    if starts:
        began = max(m["t"] for m in starts.values())
        seconds["restart"] = began - (at if failed is None else failed)
        previous = began
        for phase, name in _NAMES:
            if phase in firsts:
                seconds[name], previous = firsts[phase] - previous, firsts[phase]
    back = None
    if "restored" in firsts:
        first_step = next((m["t"] for m in after if m["phase"] == "step" and m["t"] > firsts["restored"]), None)
        back = None if first_step is None else first_step - at
    if restored is not None:
        seconds["replay"] = max(0, step - restored) * step_s
    return Failure(kind, at, step, restored, seconds, back)


_NAMES = (("imported", "imports"), ("group", "group"), ("model", "model"), ("setup", "setup"), ("restored", "restore"))
"""Each mark, and the phase that ends at it."""


def _first(marks: list[dict[str, Any]], rank: int, phase: str, since: float) -> float | None:
    return next((m["t"] for m in marks if m["rank"] == rank and m["phase"] == phase and m["t"] >= since), None)
