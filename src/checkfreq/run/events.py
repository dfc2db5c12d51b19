"""The run's event log: one JSON object per line in ``<directory>/events.jsonl``.

Schema (every record has ``event``, ``time`` (seconds since the epoch) and ``rank`` (the process's
rank under torch.distributed, 0 for one process; logs written before ranks were recorded have
none, which means 0); a measurement not taken yet is ``null``; docs/cli.md describes every field).
Every rank of a distributed job appends to the same log:
- ``{"event": "start", "pid", "process_started", "policy", "keep"}`` — a Checkpointer opened the
  directory; ``process_started``: when its process began (seconds since the epoch; null where
  ``/proc`` cannot tell);
- ``{"event": "snapshot", "step", "stall_s", "bytes", "policy", "reason", "epoch", "interval_steps",
  "interval_s", "iteration_s", "iteration_persisting_s", "clean_iterations", "clean_iteration_s",
  "away_s"}`` — training thread blocked for ``stall_s``; the interval is the one the policy chose
  (steps and seconds since the previous checkpoint); the iteration times are the profiler's
  smoothed estimates without and with a persist overlapping; ``clean_iteration_s`` is the mean of
  the ``clean_iterations`` iterations of that interval that neither overlapped a persist nor held
  a stall (their other work left out); ``away_s`` the seconds of the interval the loop spent on
  other work between steps (an evaluation: the profiler's ``away``);
- ``{"event": "fence", "step", "wait_s", "stall_s"}`` — the next optimizer step waited ``wait_s`` for
  the deferred copies of checkpoint ``step``; ``stall_s`` is that checkpoint's total stall;
- ``{"event": "memory", "step", "stall_s", "bytes"}`` — a snapshot into the memory tier only
  (shared memory, no persist); the training thread blocked for ``stall_s`` (not counting the
  fence wait for its deferred copies at the next optimizer step);
- ``{"event": "commit", "step", "persist_s", "bytes", "bandwidth_gbps"}`` — checkpoint durable;
- ``{"event": "error", "step", "message"}`` — a persist failed;
- ``{"event": "busy", "step", "waiting_for", "wait_s", "interval_steps", "persist_s", "bandwidth_gbps"}``
  — a checkpoint (or memory snapshot) waited ``wait_s`` for the previous ``"persist"`` (or
  ``"memory"`` snapshot) to be written (:mod:`checkfreq.run.busy`);
- ``{"event": "gpu_wait", "step", "wait_s", "at", "memory"}`` — a CUDA training stream waited
  ``wait_s`` (timed on the GPU) on the copies of the snapshot of ``step``;
- ``{"event": "restore", "step", "skipped": [[name, reason], ...], "tier", "seeded", "world_size",
  "saved_world_size", "restore_s"}`` — ``tier`` is where the state came from: ``"memory"``,
  ``"local"`` or ``"remote"``; ``restore_s`` how long ``restore()`` took, reads included; ``seeded``
  lists what the checkpoint carried into the new session (``"profile"``, ``"policy"``).
Lines are appended without fsync: the log is for people and plots, not for recovery.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from pathlib import Path
from typing import Any

EVENTS_NAME = "events.jsonl"
log = logging.getLogger("checkfreq.events")


class EventLog:
    """Appends one process's records (tagged with its ``rank``) from any thread."""

    def __init__(self, directory: Path, rank: int = 0) -> None:
        self.path = directory / EVENTS_NAME
        self.rank = rank
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        record = {"event": event, "time": time.time(), "rank": self.rank, **{k: _finite(v) for k, v in fields.items()}}
        line = json.dumps(record) + "\n"
        try:
            with self._lock, open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
        except OSError as e:  # the log must never break training or hide the error being reported
            log.debug("could not append to %s: %s", self.path, e)


def _finite(value: Any) -> Any:
    """NaN/inf (a measurement not taken yet) become ``null``, so every line is strict JSON."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def read_events(directory: str | Path) -> list[dict[str, Any]]:
    """All records of a run's event log (an empty list if there is none); torn last lines are skipped."""
    path = Path(directory) / EVENTS_NAME
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records
