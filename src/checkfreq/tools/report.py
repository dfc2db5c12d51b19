"""A run's checkpointing timeline from its event log: per-checkpoint records and a summary
(:mod:`checkfreq.tools.report_files` draws and writes them).

Overhead is estimated per window between two consecutive checkpoints of one session as the share
of the window's wall time, less the loop's other work between steps (``away_s``: an evaluation),
not explained by clean iterations::

    overhead = 1 - min(interval_steps * clean_iteration_s, interval_s - away_s - stall_s) / (interval_s - away_s)

where ``clean_iteration_s`` is the mean time of the window's iterations that neither overlapped a
persist nor held a stall; for a window without such an iteration, the mean over the whole run's
clean iterations, and without any, the profiler's smoothed ``iteration_s``. So it
counts the stall, the slowdown of iterations that overlap a persist, and what else the loop did
in that window that the profiler could not tell apart from them (logs written before ``away_s``
have none: their evaluations count). Steps that ran faster than the yardstick (timing noise on a
shared machine) explain no more than the window less its stall, so the figure is never below the
stall's share, nor below zero. The first checkpoint after a start or a restore is left out (its window
includes setup). The run's overhead is the same ratio over the sums of all counted windows.

Under torch.distributed every rank logs its own events into its directory's log. A checkpoint, a
session and a restore are counted once, from the events of the lowest rank that logged into it in
each session (rank 0 in a directory every rank shares; another rank in the directory of a node
without rank 0); each rank's own stalls are kept apart in :attr:`RunReport.rank_stalls`.

A session is one Checkpointer's life in the directory, from its ``start`` event (a process that
restored after a failure starts a new one); each session is also summarised on its own, so a
resumed session that checkpoints differently from the first one shows.
"""

from __future__ import annotations

import logging
import os
import statistics
from pathlib import Path
from typing import Any

from checkfreq.errors import CheckfreqError
from checkfreq.run.events import EVENTS_NAME, read_events
from checkfreq.tools.report_copies import copy_lag
from checkfreq.tools.report_model import CheckpointRecord, RunReport, SessionSummary, Summary
from checkfreq.tools.report_restarts import restarts
from checkfreq.tools.report_text import (  # noqa: F401 - the text is part of this module's API
    human_bytes,
    human_seconds,
    number_text,
    overhead_text,
    session_line,
    summary_text,
)

log = logging.getLogger("checkfreq.report")


def load_run(directory: str | os.PathLike[str]) -> RunReport:
    """Read ``DIR/events.jsonl`` into a :class:`RunReport` (records matched to their outcomes)."""
    directory = Path(directory)
    events = read_events(directory)
    if not events:
        raise CheckfreqError(f"{directory} has no event log ({EVENTS_NAME}); is it a checkfreq run directory?")
    report = RunReport(
        str(directory),
        start_time=events[0]["time"],
        rank_stalls=_rank_stalls(events),
        copy_lag=copy_lag(events),
        restarts=restarts(events),
    )
    open_by_step: dict[int, CheckpointRecord] = {}
    new_session, sessions = True, 0
    for event in _lowest_rank_events(events):
        kind = event.get("event")
        if kind == "start":
            new_session, sessions = True, sessions + 1
            report.starts.append(
                {
                    "time": event["time"],
                    "policy": event.get("policy"),
                    "restored_step": None,
                    "seeded": [],
                    "resized": None,
                }
            )
        elif kind == "restore":
            new_session = True
            sizes = (event.get("saved_world_size"), event.get("world_size"))
            report.restores.append(
                {
                    "time": event["time"],
                    "step": event.get("step"),
                    "skipped": event.get("skipped", []),
                    "tier": event.get("tier"),
                    "saved_world_size": sizes[0],
                    "world_size": sizes[1],
                }
            )
            if report.starts and report.starts[-1]["restored_step"] is None:
                report.starts[-1].update(
                    restored_step=event.get("step"),
                    seeded=list(event.get("seeded", [])),
                    resized=sizes if None not in sizes and sizes[0] != sizes[1] else None,
                )
        elif kind == "memory":
            report.memory_snapshots.append({k: event.get(k) for k in ("time", "step", "stall_s", "bytes")})
        elif kind in ("replica", "replica skipped", "replica refused", "replica wait"):
            report.replicas.append(
                {k: event.get(k) for k in ("event", "time", "step", "rank", "bytes", "seconds", "kept", "reason")}
            )
        elif kind in ("busy", "gpu_wait"):
            report.waits.append({"event": kind, **{k: event.get(k) for k in ("time", "step", "wait_s", "waiting_for")}})
        elif kind == "snapshot":
            record = _record(event, new_session, max(sessions - 1, 0))
            new_session = False
            report.records.append(record)
            open_by_step[record.step] = record
        elif kind in ("fence", "commit", "error") and event.get("step") in open_by_step:
            _apply_outcome(open_by_step[event["step"]], event)
    _estimate_overheads(report.records)
    report.summary = summarize(report, sessions, wall_s=events[-1]["time"] - events[0]["time"])
    report.sessions = [summarize_session(report, i) for i in range(len(report.starts))]
    return report


def _lowest_rank_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events of the lowest rank in each session of the log.

    Every rank of a session logs its ``start`` before any rank logs anything else (building the
    Checkpointer is collective), so a session is a run of ``start`` events and what follows them.
    """
    chosen: list[dict[str, Any]] = []
    session: list[dict[str, Any]] = []
    for event in events:
        if event.get("event") == "start" and session and session[-1].get("event") != "start":
            chosen += _of_lowest_rank(session)
            session = []
        session.append(event)
    return chosen + _of_lowest_rank(session)


def _of_lowest_rank(session: list[dict[str, Any]]) -> list[dict[str, Any]]:
    lowest = min((e.get("rank", 0) for e in session if e.get("event") == "start"), default=0)
    return [e for e in session if e.get("rank", 0) == lowest]


def _rank_stalls(events: list[dict[str, Any]]) -> dict[int, list[float]]:
    """Each rank's stall per checkpoint, in log order (the fenced total where a fence followed)."""
    by_rank: dict[int, list[list[Any]]] = {}
    for event in events:
        entries = by_rank.setdefault(event.get("rank", 0), [])
        if event.get("event") == "snapshot":
            entries.append([event.get("step"), event.get("stall_s")])
        elif event.get("event") == "fence":
            same_step = [e for e in entries if e[0] == event.get("step")]
            if same_step:
                same_step[-1][1] = event.get("stall_s", same_step[-1][1])
    return {rank: [s for _, s in entries if s is not None] for rank, entries in sorted(by_rank.items()) if entries}


def _record(event: dict[str, Any], first: bool, session: int) -> CheckpointRecord:
    return CheckpointRecord(
        step=event["step"],
        time=event["time"],
        stall_s=event.get("stall_s"),
        bytes=event.get("bytes"),
        reason=event.get("reason"),
        policy=event.get("policy"),
        epoch=event.get("epoch"),
        interval_steps=event.get("interval_steps"),
        interval_s=event.get("interval_s"),
        iteration_s=event.get("iteration_s"),
        iteration_persisting_s=event.get("iteration_persisting_s"),
        clean_iterations=event.get("clean_iterations"),
        clean_iteration_s=event.get("clean_iteration_s"),
        first_of_session=first,
        session=session,
        away_s=event.get("away_s") or 0.0,
    )


def _apply_outcome(record: CheckpointRecord, event: dict[str, Any]) -> None:
    kind = event["event"]
    if kind == "fence":
        record.stall_s = event.get("stall_s", record.stall_s)
    elif kind == "commit":
        record.status, record.persist_s, record.bandwidth_gbps = (
            "committed",
            event.get("persist_s"),
            event.get("bandwidth_gbps"),
        )
        record.bytes = event.get("bytes", record.bytes)  # the file as written, header included
    else:
        record.status, record.error = "failed", event.get("message")


def _estimate_overheads(records: list[CheckpointRecord]) -> None:
    run_clean = _clean_mean(records)
    for r in records:
        r.baseline_iteration_s = next(
            (v for v in (r.clean_iteration_s, run_clean, r.iteration_s) if v is not None), None
        )
        if not r.first_of_session and r.interval_steps and r.busy_s > 0 and r.baseline_iteration_s:
            r.overhead = 1.0 - r.explained_s / r.busy_s


def summarize(report: RunReport, sessions: int, wall_s: float) -> Summary:
    """The run's numbers from its records (see the module docstring for overhead)."""
    recs = report.records
    stalls = _values(r.stall_s for r in recs)
    committed = [r for r in recs if r.status == "committed"]
    counted = [r for r in recs if r.overhead is not None]
    explained = sum(r.explained_s for r in counted)
    window = sum(r.busy_s for r in counted)
    return Summary(
        sessions=sessions,
        restores=len(report.restores),
        checkpoints=len(recs),
        committed=len(committed),
        failed=sum(r.status == "failed" for r in recs),
        unfinished=sum(r.status == "unfinished" for r in recs),
        first_step=recs[0].step if recs else None,
        last_step=recs[-1].step if recs else None,
        wall_s=wall_s,
        stall_total_s=sum(stalls),
        stall_median_s=_median(stalls),
        stall_max_s=max(stalls, default=None),
        persist_median_s=_median(_values(r.persist_s for r in committed)),
        bandwidth_median_gbps=_median(_values(r.bandwidth_gbps for r in committed)),
        bytes_per_checkpoint=_median_int(_values(r.bytes for r in recs)),
        bytes_written=sum(r.bytes or 0 for r in committed),
        interval_median_steps=_median(_values(r.interval_steps for r in recs if not r.first_of_session)),
        interval_median_s=_median(_values(r.interval_s for r in recs if not r.first_of_session)),
        clean_iteration_s=_clean_mean(recs),
        iteration_s=_last(r.iteration_s for r in recs),
        iteration_persisting_s=_last(r.iteration_persisting_s for r in recs),
        overhead=1.0 - explained / window if window > 0 else None,
    )


def summarize_session(report: RunReport, index: int) -> SessionSummary:
    """Session ``index``'s numbers (see :class:`SessionSummary`)."""
    start = report.starts[index]
    recs = [r for r in report.records if r.session == index]
    counted = [r for r in recs if r.overhead is not None]
    window = sum(r.busy_s for r in counted)
    explained = sum(r.explained_s for r in counted)
    begin = start["restored_step"] or 0
    span = recs[-1].step - begin if recs else 0
    return SessionSummary(
        index=index,
        start_time=start["time"],
        policy=start["policy"],
        restored_step=start["restored_step"],
        seeded=tuple(start["seeded"]),
        resized=start.get("resized"),
        checkpoints=len(recs),
        first_step=recs[0].step if recs else None,
        last_step=recs[-1].step if recs else None,
        interval_median_steps=_median(_values(r.interval_steps for r in recs if not r.first_of_session)),
        checkpoints_per_step=len(recs) / span if span > 0 else None,
        overhead=1.0 - explained / window if window > 0 else None,
    )


def _values(items: Any) -> list[Any]:
    return [v for v in items if v is not None]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _median_int(values: list[int]) -> int | None:
    return int(statistics.median_low(values)) if values else None


def _clean_mean(records: list[CheckpointRecord]) -> float | None:
    windows = [(r.clean_iterations, r.clean_iteration_s) for r in records if r.clean_iterations and r.clean_iteration_s]
    count = sum(n for n, _ in windows)
    return sum(n * mean for n, mean in windows) / count if count else None


def _last(items: Any) -> float | None:
    values = _values(items)
    return values[-1] if values else None
