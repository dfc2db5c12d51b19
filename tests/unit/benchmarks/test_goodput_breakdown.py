"""What a failure cost, read from a goodput run's marks (``benchmarks.goodput_breakdown``): each phase
the slowest rank's, the steps replayed, kill to training."""

from __future__ import annotations

import sys

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT))

from benchmarks.goodput_breakdown import failures, step_seconds  # noqa: E402


def _mark(t: float, phase: str, rank: int, **fields: int) -> dict[str, object]:
    return {"t": t, "phase": phase, "rank": rank, "life": 0, **fields}


def _start(at: float, rank: int, restored: int, slow: float = 0.0) -> list[dict[str, object]]:
    """A rank's marks of one start beginning at ``at`` (``slow``: seconds more for its imports)."""
    return [
        _mark(at, "start", rank),
        _mark(at + 1.0 + slow, "imported", rank),
        _mark(at + 1.5 + slow, "group", rank),
        _mark(at + 2.5 + slow, "model", rank),
        _mark(at + 3.0 + slow, "setup", rank),
        _mark(at + 3.25 + slow, "restored", rank, step=restored),
    ]


def test_each_phase_is_the_slowest_ranks_and_the_replay_is_counted_at_the_fault_free_step_time() -> None:
    steps = [_mark(1.0 + 0.1 * s, "step", 0, step=s) for s in range(1, 11)]  # 0.1 s a step, step 10 at 2.0
    after = [*_start(4.0, 0, 8), *_start(4.0, 1, 8, slow=0.5), _mark(3.0, "failed", 1)]
    first_again = _mark(7.9, "step", 0, step=9)
    marks = sorted([*steps, *after, first_again], key=lambda m: float(m["t"]))  # type: ignore[arg-type]
    step_s = step_seconds(marks)
    assert step_s == pytest.approx(0.1)
    (failure,) = failures(marks, [{"t": 2.05, "kind": "rank"}], step_s)
    assert (failure.step_at_kill, failure.restored, failure.replayed) == (10, 8, 2)
    expected = {
        "detect": 0.95,  # the kill to the first survivor's error
        "restart": 1.0,  # the error to the new processes
        "imports": 1.5,  # rank 1's, the slower
        "group": 0.5,
        "model": 1.0,
        "setup": 0.5,
        "restore": 0.25,
        "replay": 0.2,
    }
    assert failure.seconds == pytest.approx(expected)
    assert failure.back_s == pytest.approx(7.9 - 2.05) and failure.cost_s == pytest.approx(7.9 - 2.05 + 0.2)


def test_a_kill_the_job_never_came_back_from_costs_no_figure() -> None:
    marks = [_mark(1.0, "step", 0, step=1), _mark(1.1, "step", 0, step=2)]
    (failure,) = failures(marks, [{"t": 1.2, "kind": "node"}], 0.1)
    assert failure.restored is None and failure.replayed is None and failure.back_s is None
    assert failure.cost_s is None and failure.seconds == {}
    assert failures(marks, [], 0.1) == []
