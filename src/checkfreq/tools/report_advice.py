"""Why a run's measured overhead is over the bound ``policy="auto"`` keeps to, as far as its event
log tells, and what to do: a fixed policy, a loaded machine, the first checkpoints of a session
(before the profiler's estimates settle), storage still busy with the previous persist."""

from __future__ import annotations

from checkfreq.policies.auto import Auto
from checkfreq.tools.report_model import CheckpointRecord, RunReport

BOUND = Auto.p
"""The overhead ``policy="auto"`` (the default) and ``Overhead`` keep to unless given another ``p``."""
ADAPTIVE = ("Auto", "Overhead")
FIXED = ("Every", "EveryEpoch")
SETTLING = 3
"""The windows at the start of each session counted as settling (the costs being measured)."""
NOISY = 2.0
"""Clean step times spread by more than this factor: the machine was busy with other work."""


def overhead_advice(report: RunReport) -> list[str]:
    """One line per cause the log shows for an overhead over :data:`BOUND` (none when within it)."""
    s = report.summary
    if s is None or s.overhead is None or s.overhead <= BOUND:
        return []
    counted = [r for r in report.records if r.overhead is not None]
    policies = sorted({str(start["policy"]) for start in report.starts if start.get("policy")})
    lines = [f"over the {100 * BOUND:.1f} % that policy='auto' (the default) keeps to; what the log shows:"]
    fixed = [p for p in policies if p in FIXED]
    if fixed:
        lines.append(
            f"- a fixed policy ({', '.join(fixed)}): it checkpoints at the interval it was given, whatever that "
            "costs here. To do: policy='auto', or a longer interval (`checkfreq plan` computes one from the "
            "step, stall and persist times above)"
        )
    elif any(p not in ADAPTIVE for p in policies):
        lines.append(
            f"- the policy ({', '.join(policies)}) does not keep to an overhead bound. To do: "
            "policy='auto' if the bound is what you want"
        )
    spread = _spread(counted)
    if spread is not None and spread[1] > NOISY * spread[0]:
        lines.append(
            f"- a loaded machine: the clean steps' mean time per window ran from {_ms(spread[0])} to "
            f"{_ms(spread[1])}: other work held steps up, and the figure mixes its delays in (a step held up "
            "while a persist ran counts as overhead). To do: measure on a machine free of other jobs"
        )
    settled = _overhead([r for r in counted if _position(report.records, r) >= SETTLING])
    if not fixed and settled is not None and settled <= BOUND:  # a fixed interval has nothing to settle
        lines.append(
            f"- the first checkpoints of each session: while the profiler measures the costs and the policy "
            f"settles its interval, checkpoints cost more; without the first {SETTLING} windows of each "
            f"session the overhead is {100 * settled:.2f} %. To do: nothing: in a longer run they weigh less"
        )
    elif not fixed and len(counted) < 2 * SETTLING:
        lines.append(
            f"- a short run: {len(counted)} window(s) measured, too few for the policy to settle. "
            "To do: judge the overhead over a longer run"
        )
    waits = [w for w in report.waits if w["event"] == "busy"]
    if waits:
        lines.append(
            f"- busy storage: {len(waits)} checkpoint(s) waited for the previous persist, which outlasted the "
            'interval. To do: faster storage, or a longer interval (docs/policies.md, "When storage is busy")'
        )
    if len(lines) == 1:
        lines.append(
            "- none of the usual causes (a fixed policy, a loaded machine, the first checkpoints, busy "
            "storage). To do: compare the stall with the step time above, and see docs/performance.md"
        )
    return lines


def _spread(counted: list[CheckpointRecord]) -> tuple[float, float] | None:
    means = [r.clean_iteration_s for r in counted if r.clean_iterations and r.clean_iteration_s]
    return (min(means), max(means)) if len(means) >= 2 else None


def _position(records: list[CheckpointRecord], record: CheckpointRecord) -> int:
    """How many counted windows of its session come before ``record``."""
    return sum(1 for r in records if r.session == record.session and r.overhead is not None and r.time < record.time)


def _overhead(records: list[CheckpointRecord]) -> float | None:
    window = sum(r.busy_s for r in records)
    explained = sum(r.explained_s for r in records)
    return 1.0 - explained / window if window > 0 else None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"
