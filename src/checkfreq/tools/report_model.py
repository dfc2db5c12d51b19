"""The records and summaries of a run's report (:mod:`checkfreq.tools.report` builds them from the
event log; :mod:`checkfreq.tools.report_text` says them in words)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from checkfreq.tools.report_copies import CopyLag
from checkfreq.tools.report_restarts import Restart


@dataclass
class CheckpointRecord:
    """One checkpoint as the event log tells it (``None``: not recorded)."""

    step: int
    time: float
    """When its snapshot finished (seconds since the epoch)."""
    stall_s: float | None
    """Total time the training loop was blocked by it (snapshot plus fence wait)."""
    bytes: int | None
    """Bytes of the data written (the snapshot's size until the commit reports the file's)."""
    reason: str | None
    policy: str | None
    epoch: int | None
    interval_steps: int | None
    interval_s: float | None
    iteration_s: float | None
    iteration_persisting_s: float | None
    clean_iterations: int | None
    clean_iteration_s: float | None
    first_of_session: bool
    away_s: float = 0.0
    """Seconds of the window the loop spent on other work between steps (0 in older logs)."""
    session: int = 0
    """Index of the session (``start`` event) that took it, from 0."""
    status: str = "unfinished"
    """``committed``, ``failed``, or ``unfinished`` (no outcome logged: the process died or is still writing)."""
    persist_s: float | None = None
    bandwidth_gbps: float | None = None
    error: str | None = None
    baseline_iteration_s: float | None = None
    """The iteration time without checkpointing this window's overhead is measured against."""
    overhead: float | None = None
    """This window's overhead (see the module docstring); None when it cannot be estimated."""

    @property
    def busy_s(self) -> float:
        """The window's seconds of training and checkpointing: its wall time less the other work."""
        return (self.interval_s or 0.0) - self.away_s

    @property
    def explained_s(self) -> float:
        """The window's seconds its clean steps account for: its steps at the baseline iteration time,
        never more than the window less its stall (steps faster than the baseline are timing noise,
        not a negative cost), so its overhead is at least the stall's share and never below zero."""
        steps = (self.interval_steps or 0) * (self.baseline_iteration_s or 0.0)
        return max(0.0, min(steps, self.busy_s - (self.stall_s or 0.0)))


@dataclass(frozen=True)
class Summary:
    """The run in numbers; medians unless named otherwise; ``None`` where nothing was measured."""

    sessions: int
    restores: int
    checkpoints: int
    committed: int
    failed: int
    unfinished: int
    first_step: int | None
    last_step: int | None
    wall_s: float
    stall_total_s: float
    stall_median_s: float | None
    stall_max_s: float | None
    persist_median_s: float | None
    bandwidth_median_gbps: float | None
    bytes_per_checkpoint: int | None
    bytes_written: int
    interval_median_steps: float | None
    interval_median_s: float | None
    clean_iteration_s: float | None
    """Mean clean iteration time (no stall, no persist overlapping) over all windows that had one."""
    iteration_s: float | None
    """The last smoothed iteration time without a persist overlapping."""
    iteration_persisting_s: float | None
    """The last smoothed iteration time while a persist overlapped."""
    overhead: float | None


@dataclass(frozen=True)
class SessionSummary:
    """One session: what it resumed from and how it checkpointed (``None``: nothing to say)."""

    index: int
    start_time: float
    policy: str | None
    restored_step: int | None
    """The step it restored (``None``: it did not restore)."""
    seeded: tuple[str, ...]
    """What the restored checkpoint carried into it (``profile``, ``policy``); see docs/policies.md."""
    resized: tuple[int, int] | None
    """(saved world size, world size) when it restored a checkpoint written by another number of ranks."""
    checkpoints: int
    first_step: int | None
    last_step: int | None
    interval_median_steps: float | None
    checkpoints_per_step: float | None
    """Checkpoints per step from its first step to its last checkpoint."""
    overhead: float | None
    """Its own overhead: the run's ratio over this session's counted windows."""


@dataclass
class RunReport:
    """Everything ``checkfreq report`` shows."""

    directory: str
    start_time: float
    """Time of the log's first event (seconds since the epoch): the timeline's zero."""
    records: list[CheckpointRecord] = field(default_factory=list)
    restores: list[dict[str, Any]] = field(default_factory=list)
    starts: list[dict[str, Any]] = field(default_factory=list)
    """Each session's ``start`` event, and its restore (``restored_step``, ``seeded``) if it had one."""
    memory_snapshots: list[dict[str, Any]] = field(default_factory=list)
    """The memory tier's snapshots (``time``, ``step``, ``stall_s``, ``bytes``): a series apart from persists."""
    waits: list[dict[str, Any]] = field(default_factory=list)
    """The ``busy`` waits (for the previous persist or memory snapshot) and ``gpu_wait`` waits."""
    replicas: list[dict[str, Any]] = field(default_factory=list)
    """The memory tier's copies to another machine (``replica``, ``replica skipped``, ``replica refused``,
    ``replica wait``)."""
    copy_lag: CopyLag | None = None
    """How far the copies on other machines lagged the snapshots, every rank's (None: no copy kept)."""
    restarts: list[Restart] = field(default_factory=list)
    """What each restart cost (rank 0's events)."""
    summary: Summary | None = None
    rank_stalls: dict[int, list[float]] = field(default_factory=dict)
    """Each rank's stall per checkpoint, in log order (one entry for a single process)."""
    sessions: list[SessionSummary] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "directory": self.directory,
            "start_time": self.start_time,
            "summary": asdict(self.summary) if self.summary else None,
            "sessions": [asdict(s) for s in self.sessions],
            "checkpoints": [asdict(r) for r in self.records],
            "restores": self.restores,
            "rank_stalls": self.rank_stalls,
            "memory_snapshots": self.memory_snapshots,
            "replicas": self.replicas,
            "copy_lag": asdict(self.copy_lag) if self.copy_lag else None,
            "restarts": [asdict(r) for r in self.restarts],
            "waits": self.waits,
        }
