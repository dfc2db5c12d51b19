"""A run's report in words (:mod:`checkfreq.tools.report` computes it): the summary a person reads
first, each figure said for what it is, and, when the overhead is over the bound, why, from what
the event log shows, and what to do (:mod:`checkfreq.tools.report_advice`)."""

from __future__ import annotations

import statistics
from typing import Any

from checkfreq.run.units import human_bytes, human_rate
from checkfreq.tools.report_advice import overhead_advice
from checkfreq.tools.report_copies import CopyLag
from checkfreq.tools.report_model import RunReport, SessionSummary
from checkfreq.tools.report_restarts import Restart


def _values(items: Any) -> list[Any]:
    return [v for v in items if v is not None]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summary_text(report: RunReport) -> str:
    """A few plain lines a person reads first."""
    s = report.summary
    assert s is not None
    lines = [
        f"run {report.directory}: {s.checkpoints} checkpoints ({s.committed} committed, {s.failed} failed, "
        f"{s.unfinished} unfinished), {s.sessions} session(s), {s.restores} restore(s), "
        f"{human_seconds(s.wall_s)} logged",
    ]
    if s.checkpoints:
        lines.append(
            f"steps {s.first_step}..{s.last_step}; interval the policy chose: median "
            f"{number_text(s.interval_median_steps, '{:g}')} steps ({human_seconds(s.interval_median_s)})"
        )
        lines.append(
            f"stall per checkpoint: median {human_seconds(s.stall_median_s)}, max {human_seconds(s.stall_max_s)}, "
            f"total {human_seconds(s.stall_total_s)}"
        )
        lines.append(
            f"persist: median {human_seconds(s.persist_median_s)} "
            f"at {human_rate(None if s.bandwidth_median_gbps is None else s.bandwidth_median_gbps * 1e9)}, "
            f"{human_bytes(s.bytes_per_checkpoint)} data file per checkpoint, {human_bytes(s.bytes_written)} written"
        )
    if len(report.rank_stalls) > 1:
        lines.append(
            "stall per rank: "
            + "; ".join(
                f"rank {rank} median {human_seconds(_median(stalls))}, max {human_seconds(max(stalls, default=None))}"
                for rank, stalls in report.rank_stalls.items()
            )
        )
    lines.append(
        f"step time: {human_seconds(s.clean_iteration_s)} on average over the clean steps (no persist running, "
        f"no stall: what the overhead is measured against); the profiler's smoothed estimate at the end: "
        f"{human_seconds(s.iteration_s)} per step, {human_seconds(s.iteration_persisting_s)} while a persist runs"
        + _mean_far_from_smoothed(s.clean_iteration_s, s.iteration_s)
    )
    if report.memory_snapshots:
        stalls = _values(m["stall_s"] for m in report.memory_snapshots)
        lines.append(
            f"memory tier: {len(report.memory_snapshots)} snapshots besides the checkpoints, stall median "
            f"{human_seconds(_median(stalls))}, total {human_seconds(sum(stalls))}"
        )
    if report.replicas:
        lines.append(_replicas_line(report.replicas))
        if report.copy_lag is not None:
            lines.append(_copy_lag_line(report.copy_lag))
    for kind, what in (
        ("busy", "waited for busy storage (the previous persist or memory snapshot)"),
        ("gpu_wait", "GPU streams waited on snapshot copies"),
    ):
        waits = _values(w["wait_s"] for w in report.waits if w["event"] == kind)
        if waits:
            lines.append(
                f"{what}: {len(waits)} times, total {human_seconds(sum(waits))}, max {human_seconds(max(waits))}"
            )
    if report.restarts:
        lines.append(_restarts_line(report.restarts))
    meaning = (
        ""
        if s.overhead is None
        else (
            ": the share of the time between checkpoints (other work between steps left out) that clean steps "
            "do not account for, that is, the stalls and the steps a persist slowed"
        )
    )
    lines.append(f"overhead: {overhead_text(s.overhead, ' of wall time')}{meaning}")
    lines.extend(overhead_advice(report))
    if len(report.sessions) > 1:
        lines.extend(session_line(session) for session in report.sessions)
    return "\n".join(lines)


def _restarts_line(restarts: list[Restart]) -> str:
    """What the restarts cost, each part's median (docs/cli.md, "report"); n/a where not recorded."""
    replayed = [r.replayed for r in restarts]
    return (
        f"restarts: {len(restarts)}, each (median) down {human_seconds(_median(_values(r.down_s for r in restarts)))} "
        "(from the last event before it to the new process: detection, exit, the launcher's restart; at most), "
        f"the script's start {human_seconds(_median(_values(r.script_s for r in restarts)))} (imports, process "
        f"group, model), the restore {human_seconds(_median([r.restore_s for r in restarts]))}, steps replayed "
        f"at least {statistics.median(replayed):g} (max {max(replayed)})"
    )


def _mean_far_from_smoothed(mean: float | None, smoothed: float | None) -> str:
    """What a person should make of a clean mean far from the smoothed estimate, or ``""``."""
    if mean is None or not smoothed or 0.5 < mean / smoothed < 2:
        return ""
    return (
        " (far apart: the mean counts every clean step, the smoothed estimate passes over the few that "
        "something else held up, on a loaded machine, or that ran in another phase of the loop)"
    )


def session_line(s: SessionSummary) -> str:
    """One session in a line: where it started, its checkpoints, interval and overhead."""
    began = "started fresh" if s.restored_step is None else f"restored step {s.restored_step}"
    if s.resized:
        began += f" on {s.resized[1]} rank(s), saved by {s.resized[0]}"
    if s.seeded:
        began += f" ({carried_text(s.seeded)})"
    head = f"session {s.index + 1}: {began}; "
    if not s.checkpoints:
        return head + "no checkpoint"
    taken = (
        f"1 checkpoint, at step {s.last_step}"
        if s.checkpoints == 1
        else (f"{s.checkpoints} checkpoints, steps {s.first_step}..{s.last_step}")
    )
    rate = number_text(None if s.checkpoints_per_step is None else 1000 * s.checkpoints_per_step, "{:.3g}")
    if s.interval_median_steps is None and s.overhead is None:
        measured = (
            "interval and overhead not measured: the window up to a session's first checkpoint holds its "
            "start-up, so they need a second checkpoint"
        )
    else:
        interval = number_text(s.interval_median_steps, "{:g}")
        measured = f"interval median {interval} steps, overhead {overhead_text(s.overhead)}"
    return f"{head}{taken}, {rate} per 1000 steps, {measured}"


CARRIED = {
    "profile": "the step and checkpoint costs measured before",
    "policy": "the policy's state (for policy='auto', the interval it chose and its overhead budget)",
}
"""What each part a checkpoint carries into the next session is, in words (docs/policies.md)."""


def carried_text(seeded: tuple[str, ...] | list[str]) -> str:
    """What a restored session took over from its checkpoint and why it matters, in words."""
    parts = " and ".join(CARRIED.get(part, part) for part in seeded)
    return f"took over {parts}, so it goes on from what the run had learned instead of learning it afresh"


def overhead_text(overhead: float | None, unit: str = "") -> str:
    """An overhead as a percentage followed by ``unit``."""
    return f"n/a %{unit}" if overhead is None else f"{100 * overhead:.2f} %{unit}"


def number_text(value: float | None, fmt: str) -> str:
    """``value`` formatted with ``fmt``, or ``n/a`` when it was not measured."""
    return "n/a" if value is None else fmt.format(value)


def human_seconds(seconds: float | None) -> str:
    """A duration for people: ``850 µs``, ``12.3 ms``, ``4.56 s``, ``12.0 min``, ``30.5 h``; ``n/a`` for None."""
    if seconds is None:
        return "n/a"
    seconds = float(f"{seconds:.3g}")  # rounded first, so 0.9999 s reads 1 s, not 1e+03 ms
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    if seconds < 600:
        return f"{seconds:.3g} s"
    return f"{seconds / 60:.1f} min" if seconds < 6 * 3600 else f"{seconds / 3600:.1f} h"


def _replicas_line(events: list[dict[str, Any]]) -> str:
    """The memory tier's copies on another machine (``replicas=1``) in one line."""
    kept = [e for e in events if e["event"] == "replica" and e.get("kept")]
    skipped = [e for e in events if e["event"] == "replica skipped"]
    waited = [e for e in events if e["event"] == "replica wait"]
    refused = [e for e in events if e["event"] == "replica" and not e.get("kept")]  # the sender's side of each
    line = (
        f"memory copies on another machine: {len(kept)} kept there "
        f"({human_bytes(sum(e.get('bytes') or 0 for e in kept))}, "
        f"{human_bytes(int(_median(_values(e.get('bytes') for e in kept)) or 0))} sent a snapshot, median "
        f"{human_seconds(_median(_values(e.get('seconds') for e in kept)))} each, off the training thread)"
    )
    if waited:
        line += (
            f"; {len(waited)} snapshots waited for the copies of the one before (median "
            f"{human_seconds(_median(_values(e.get('seconds') for e in waited)))}: copying is slower than snapshotting)"
        )
    if skipped:
        line += f"; {len(skipped)} not copied (the previous copy still in flight after the failure timeout)"
    if refused:
        line += f"; {len(refused)} refused by the keeper (damaged on the way)"
    return line


def _copy_lag_line(lag: CopyLag) -> str:
    """How far the copies on other machines lagged the snapshots, in one line."""
    line = (
        f"copy lag: median {human_seconds(lag.median_s)} ({lag.median_snapshots:.3g} snapshots), max "
        f"{human_seconds(lag.max_s)} ({lag.max_snapshots} snapshots) from a snapshot to its copy kept"
    )
    if lag.without_copy:
        ranks = ", ".join(map(str, lag.without_copy))
        return f"{line}; rank {ranks} had no copy kept: a node lost with it resumes from disk"
    return (
        f"{line}; at the end every rank's copy had reached step {lag.reached_step} (newest snapshot "
        f"{lag.newest_step}): a node lost then resumes from there at best"
    )
