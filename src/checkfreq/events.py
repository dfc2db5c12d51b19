"""The run's event log: one JSON object per line in ``<directory>/events.jsonl``.

Schema (every record has ``event`` and ``time``, seconds since the epoch):
- ``{"event": "snapshot", "step", "stall_s", "bytes", "policy", "reason"}`` — training thread blocked for ``stall_s``;
- ``{"event": "commit", "step", "persist_s", "bytes", "bandwidth_gbps"}`` — checkpoint durable;
- ``{"event": "error", "step", "message"}`` — a persist failed;
- ``{"event": "restore", "step", "skipped": [[name, reason], ...]}``.
Lines are appended without fsync: the log is for people and plots, not for recovery.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

EVENTS_NAME = "events.jsonl"
log = logging.getLogger("checkfreq.events")


class EventLog:
    """Appends records from any thread."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / EVENTS_NAME
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "time": time.time(), **fields}) + "\n"
        try:
            with self._lock, open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
        except OSError as e:  # the log must never break training or hide the error being reported
            log.debug("could not append to %s: %s", self.path, e)


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
