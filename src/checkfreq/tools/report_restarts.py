"""What each restart of a run cost, from rank 0's events: the time the job was down, the script's own
start (its imports, process group and model), the restore, and the steps trained again.

A restart is a session (its ``start`` event) that restored a checkpoint after another session wrote
events. Its ``down_s`` runs from the previous session's last event, the last sign of life the log
has, to this session's process start (``process_started``): the failure's detection, the exit,
the launcher's restart; as the last event may come before the failure, it is an upper bound. The
steps replayed are counted from the newest step the previous session's events name, so they are a
lower bound (a step with no event is not seen).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Restart:
    """One restart and what it cost."""

    restored: int
    tier: str
    down_s: float | None
    """The previous session's last event to this process's start (None: the start was not recorded)."""
    script_s: float | None
    """This process's start to its Checkpointer: imports, process group, model (the user's script)."""
    restore_s: float
    replayed: int
    """Steps trained again at least: the newest step the previous session named, less the one restored."""


def restarts(events: Iterable[dict[str, Any]]) -> list[Restart]:
    """Each restart in rank 0's ``events`` (in log order)."""
    found: list[Restart] = []
    last_time: float | None = None
    newest = -1
    start: dict[str, Any] | None = None
    previous_time, previous_step = None, -1  # the session before ``start``: its last event, its newest step
    for event in events:
        if event.get("rank", 0) != 0:
            continue
        kind = event.get("event")
        if kind == "start":
            start, previous_time, previous_step = event, last_time, newest
        elif kind == "restore" and start is not None and previous_time is not None:
            began = start.get("process_started")
            found.append(
                Restart(
                    restored=int(event["step"]),
                    tier=str(event.get("tier")),
                    down_s=None if began is None else began - previous_time,
                    script_s=None if began is None else start["time"] - began,
                    restore_s=float(event.get("restore_s") or 0.0),
                    replayed=max(0, previous_step - int(event["step"])),
                )
            )
            start = None
        if isinstance(event.get("step"), int):
            newest = max(newest, event["step"]) if kind != "restore" else event["step"]
        last_time = event["time"]
    return found
