"""What one simulated world of ``benchmarks/protocol_sim.py`` produced: how each rank ended
(:class:`Outcome`) and the world's counts and rank 0's measurements (:class:`Run`), which
``benchmarks/sim_report.py`` reports."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.sim_counts import Counts, Ledger
from checkfreq.pipeline.save.commit import CommitResult


@dataclass
class Outcome:
    """How one rank's run ended."""

    token: str
    directory: int
    commit: CommitResult
    restored: str
    restored_files: int
    fetched: int | None
    """The memory step the fetch round brought the lost machine's ranks."""
    adopted: int
    """Copies this rank took over in it."""


@dataclass
class Run:
    """One simulated world: every rank's counts by phase, how each ended, and rank 0's measurements."""

    world: int
    replicas: int
    """Each snapshot's copies (``replicas=``): the keepers each rank copies to."""
    wall_s: float
    threads_s: float
    """Seconds to start every rank's thread."""
    ledgers: list[Ledger]
    outcomes: list[Outcome]
    manifest_bytes: int
    manifest_parse_s: float
    restored: bool
    plan_cpu_s: float
    """Rank 0's CPU for the restore's plan over N views: each file's reader, and the orders."""
    stream_cpu_s: float
    """A rank's CPU for the stream's layout and for taking the replicated tensors out of the all-gathered rows."""
    stream_bytes: int
    """What a rank receives of the all-gathered rows: every other rank's."""
    readers: dict[str, list[int]]
    """Who reads each data file from storage at restore, by the plan."""
    file_bytes: list[int]
    copies_kept: int
    """Of the copies ``benchmarks/replica_sim.py`` ran for the "snapshot copy" counts, those kept
    (one per measured rank and keeper)."""
    slot_bytes: int
    """Rank 0's memory snapshot: its slot's data and manifest (0: no copies counted)."""
    copy_sent_bytes: int
    """What rank 0 sends of it to each keeper: the copy's data and envelope (0: no copies counted)."""
    report_bytes: list[int]
    """Each rank's memory report in the fetch round (the gather to rank 0), on the wire."""
    fetch_plan_bytes: int
    """Rank 0's plan of the fetch round, on the wire (broadcast to every rank)."""
    fetch_plan_s: float
    """Rank 0's CPU for ``fetch_plan`` over every rank's report (median of repeats)."""
    fetch_decode_s: float
    """Rank 0's CPU to decode every rank's report (median of repeats)."""

    def counts(self, phase: str) -> list[Counts]:
        return [ledger.phases.get(phase, Counts()) for ledger in self.ledgers]
