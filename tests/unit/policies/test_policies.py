"""Policies and the profiler, driven with plain numbers (no torch)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import pytest

from checkfreq.policies import (
    Auto,
    ConvergenceAware,
    DecisionContext,
    Every,
    EveryEpoch,
    Overhead,
    YoungDaly,
    resolve,
)
from checkfreq.policies.losscurve import LossCurve
from checkfreq.policies.profiler import Profiler, Smoothed

HOUR = 3600.0


@dataclass
class FakeRun:
    """A simulated training loop that feeds a policy contexts and pays for its checkpoints."""

    iteration: float
    stall: float
    persist: float
    slowdown: float = 0.0
    loss: LossCurve | None = None
    step: int = 0
    since: int = 0
    now: float = 0.0
    last: float = 0.0
    durable_at: float = -1.0
    compute: float = 0.0
    evaluation: tuple[int, float] = (0, 0.0)
    """(every, seconds): work between steps every so many steps (an evaluation)."""
    away: float = 0.0
    """Seconds of that work the profiler told apart (it took place with no persist running)."""
    away_at_checkpoint: float = 0.0
    told_apart: bool = True
    """False: the context says nothing of that work (as before the profiler measured it)."""
    intervals: list[int] = field(default_factory=list)

    def run(self, policy, steps: int) -> list[int]:  # type: ignore[no-untyped-def]
        for _ in range(steps):
            persisting = self.now < self.durable_at
            self.step += 1
            self.since += 1
            self.now += self.iteration * (1 + self.slowdown if persisting else 1)
            every, seconds = self.evaluation
            if every and self.step % every == 0:
                self.now += seconds
                self.away += seconds if self.told_apart and not persisting else 0.0
            self.compute += self.iteration
            ctx = DecisionContext(
                step=self.step,
                session_steps=self.step,
                steps_since_checkpoint=self.since,
                elapsed=self.now,
                seconds_since_checkpoint=self.now - self.last,
                iteration_time=self.iteration,
                iteration_time_while_persisting=self.iteration * (1 + self.slowdown),
                stall=self.stall,
                persist_time=self.persist,
                bytes_per_checkpoint=1,
                persist_in_flight=persisting,
                loss=float(self.loss.value(self.step)) if self.loss else None,
                away=self.away,
                away_since_checkpoint=self.away - self.away_at_checkpoint,
            )
            if policy.should_save(ctx):
                self.last, self.away_at_checkpoint = self.now, self.away
                self.now += self.stall
                self.since = 0
                self.durable_at = self.last + self.persist
            self.intervals.append(policy.interval)
        return self.intervals

    @property
    def overhead(self) -> float:
        return self.now / self.compute - 1


def test_every_and_every_epoch() -> None:
    run = FakeRun(0.01, 0.0, 0.0)
    every = Every(5)
    saved = [every.should_save(_ctx(since=s)) for s in range(1, 7)]
    assert saved == [False, False, False, False, True, True]
    assert Every(seconds=2.0).should_save(_ctx(seconds=2.5))
    assert EveryEpoch().should_save(_ctx(epoch_changed=True)) and not EveryEpoch().should_save(_ctx())
    assert run.iteration == 0.01
    with pytest.raises(ValueError, match="exactly one"):
        Every()


def _ctx(since: int = 1, seconds: float = 0.0, epoch_changed: bool = False) -> DecisionContext:
    nan = math.nan
    return DecisionContext(
        step=since,
        session_steps=since,
        steps_since_checkpoint=since,
        elapsed=seconds,
        seconds_since_checkpoint=seconds,
        iteration_time=nan,
        iteration_time_while_persisting=nan,
        stall=nan,
        persist_time=nan,
        bytes_per_checkpoint=0,
        persist_in_flight=False,
        epoch_changed=epoch_changed,
    )


def test_resolve() -> None:
    assert isinstance(resolve("auto"), Auto)
    assert resolve(7) == Every(7)
    with pytest.raises(TypeError):
        resolve("sometimes")  # type: ignore[arg-type]


def test_overhead_plans_from_stall_and_persist_and_keeps_the_bound() -> None:
    run = FakeRun(iteration=0.01, stall=0.02, persist=0.1)
    policy = Overhead(p=0.05)
    run.run(policy, 5000)
    assert policy.interval == math.ceil(0.02 / (0.9 * 0.05 * 0.01))  # stall-bound: 45 steps
    assert run.overhead <= 0.05
    assert "every 45 steps" in policy.reason


def test_overhead_counts_the_slowdown_while_persisting() -> None:
    run = FakeRun(iteration=0.01, stall=0.005, persist=0.2, slowdown=0.3)
    policy = Overhead(p=0.05)
    run.run(policy, 10_000)
    # each checkpoint costs 5 ms stall + 0.2 s · 0.3/1.3 of slowed iterations ≈ 51 ms
    assert policy.interval == math.ceil((0.005 + 0.2 * 0.3 / 1.3) / (0.9 * 0.05 * 0.01))
    assert run.overhead <= 0.05


def test_overhead_interval_grows_when_persist_slows_and_shrinks_when_it_recovers(caplog) -> None:  # type: ignore[no-untyped-def]
    run = FakeRun(iteration=0.01, stall=0.01, persist=0.1)
    policy = Overhead(p=0.05)
    with caplog.at_level(logging.INFO, logger="checkfreq.policies"):
        before = run.run(policy, 2000)[-1]
        run.persist = 3.0
        during = run.run(policy, 3000)[-1]
        run.persist = 0.1
        after = run.run(policy, 3000)[-1]
    assert during >= 300 > before  # persist must keep up: 3 s / 10 ms
    assert after == before
    assert any("costs changed" in r.getMessage() for r in caplog.records)


def test_overhead_hysteresis_ignores_small_changes() -> None:
    run = FakeRun(iteration=0.01, stall=0.02, persist=0.1)
    policy = Overhead(p=0.05, hysteresis=0.3)
    base = run.run(policy, 2000)[-1]
    run.stall = 0.017  # plan would be 38 steps: within 30 %, keep 45
    assert run.run(policy, 2000)[-1] == base
    run.stall = 0.012  # plan 27 steps: beyond the band, shrink
    assert run.run(policy, 2000)[-1] == math.ceil(0.012 / (0.9 * 0.05 * 0.01))
    run.stall = 0.0125  # any growth is applied at once: the bound comes first
    assert run.run(policy, 2000)[-1] == math.ceil(0.0125 / (0.9 * 0.05 * 0.01))


def test_overhead_measured_overhead_corrects_a_wrong_cost_model() -> None:
    run = FakeRun(iteration=0.01, stall=0.02, persist=0.1)
    policy = Overhead(p=0.05)
    run.run(policy, 3000)
    planned = policy.interval
    hidden = FakeRun(iteration=0.01, stall=0.02, persist=0.1)  # each checkpoint secretly costs 3× its stall
    original = hidden.run

    def costly(pol, steps):  # type: ignore[no-untyped-def]
        for _ in range(steps):
            since = hidden.since
            original(pol, 1)
            if hidden.since == 0 and since:
                hidden.now += 0.04
        return hidden.intervals

    policy2 = Overhead(p=0.05)
    costly(policy2, 20_000)
    assert policy2.interval > 2 * planned and policy2.correction > 2
    assert "measured overhead" in policy2.reason
    assert hidden.overhead <= 0.05


def test_overhead_does_not_count_the_loops_other_work_as_checkpointing() -> None:
    """An evaluation of 30 iterations every 100 steps (a fifth of the run): the windows measure
    the checkpoints' cost alone, so the plan is the one of the same loop without evaluations;
    counted as overhead (the time the profiler tells apart ignored), it would stretch the interval."""
    plain = Overhead(p=0.05)
    FakeRun(iteration=0.01, stall=0.02, persist=0.1).run(plain, 20_000)
    evaluating = Overhead(p=0.05)
    FakeRun(iteration=0.01, stall=0.02, persist=0.1, evaluation=(100, 0.3)).run(evaluating, 20_000)
    assert evaluating.interval <= plain.interval * 1.3 and evaluating.correction < 1.5, evaluating.reason
    blind = Overhead(p=0.05)
    FakeRun(iteration=0.01, stall=0.02, persist=0.1, evaluation=(100, 0.3), told_apart=False).run(blind, 20_000)
    assert blind.interval > 2 * plain.interval


def test_profiler_tells_the_loops_other_work_apart() -> None:
    """A step with no persist that takes over twice the iteration time held other work: its time
    beyond the iteration time is away; a slow step that a persist overlapped is a checkpoint's cost."""
    profiler = Profiler()
    for _ in range(20):
        profiler.record_iteration(0.01, persisting=False)
    profiler.record_iteration(0.015, persisting=False)  # noise
    assert profiler.away == 0.0
    profiler.record_iteration(0.31, persisting=False)  # an evaluation of 0.3 s
    assert profiler.away == pytest.approx(0.3, rel=0.05)
    profiler.record_persist(0.02, 1000)
    profiler.begin_checkpoint()
    profiler.record_iteration(0.025, persisting=True)  # slowed by the write: its cost
    assert profiler.away == pytest.approx(0.3, rel=0.05)
    profiler.record_iteration(0.33, persisting=True)  # an evaluation while the write ran: 0.02 s at most is its cost
    assert profiler.away == pytest.approx(0.3 + 0.3, rel=0.05)
    profiler.record_iteration(0.01, persisting=False)
    assert profiler.checkpoint_cost.value == pytest.approx(0.015 + 0.02, rel=0.1)


def test_overhead_defers_while_persist_in_flight_and_reacts_to_phase_change() -> None:
    run = FakeRun(iteration=0.01, stall=0.001, persist=0.5)
    policy = Overhead(p=0.05)
    run.run(policy, 3000)
    assert policy.interval == 50  # persist-bound
    run.iteration = 0.02  # a new phase: every step twice as slow
    run.run(policy, 500)
    assert policy.interval == 25 and "iteration time changed" in policy.reason


def test_overhead_parameters() -> None:
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="p must"):
            Overhead(p=bad)


def test_young_daly_policy_and_auto() -> None:
    run = FakeRun(iteration=1.0, stall=30.0, persist=60.0)
    yd = YoungDaly(mtbf=4 * HOUR)
    run.run(yd, 2000)
    assert yd.interval == 910  # Daly: 909.6 s
    fast = FakeRun(iteration=1.0, stall=30.0, persist=2000.0)
    yd2 = YoungDaly(mtbf=4 * HOUR)
    fast.run(yd2, 3000)
    assert yd2.interval == 2000  # never before the previous checkpoint is durable
    auto = Auto(p=0.035, mtbf=4 * HOUR)
    FakeRun(iteration=1.0, stall=30.0, persist=60.0).run(auto, 3000)
    assert auto.interval == max(910, math.ceil(30 / (0.9 * 0.035)))
    rare = Auto(p=0.035, mtbf=1000 * HOUR)
    FakeRun(iteration=1.0, stall=30.0, persist=60.0).run(rare, 3000)
    assert rare.interval == rare.failures.interval and rare.reason.startswith("failure-optimal")  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="mtbf"):
        YoungDaly(mtbf=0)


WORKED = LossCurve(a=0.2, b=120.0, w0=360.0, c=0.5)  # docs/algorithms.md §3, one step = one second


def test_convergence_aware_fits_the_loss_online_and_spaces_out() -> None:
    run = FakeRun(iteration=1.0, stall=30.0, persist=60.0, loss=WORKED)
    policy = ConvergenceAware(mtbf=4 * HOUR, horizon=24 * HOUR)
    intervals = run.run(policy, 4 * 3600)
    assert policy.curve is not None and "loss fit" in policy.reason
    # at 4 h the value-weighted interval is ~21.5 min (Young: 15.5)
    omega = float(WORKED.weight(4 * HOUR, 24 * HOUR))
    expected = math.sqrt(2 * 30 * 4 * HOUR / omega)
    assert intervals[-1] == pytest.approx(expected, rel=0.1)
    assert intervals[200] < intervals[-1]


def test_convergence_aware_exact_placement_and_fallback() -> None:
    silent = ConvergenceAware(mtbf=4 * HOUR, horizon=24 * HOUR)
    FakeRun(iteration=1.0, stall=30.0, persist=60.0).run(silent, 2000)
    assert silent.curve is None and silent.interval == 910 and "no loss fit" in silent.reason
    exact = ConvergenceAware(mtbf=4 * HOUR, horizon=24 * HOUR, exact=True, refit_every=500)
    run = FakeRun(iteration=1.0, stall=30.0, persist=60.0, loss=WORKED)
    intervals = run.run(exact, 3 * 3600)
    assert "exact placement" in exact.reason
    assert intervals[-1] == pytest.approx(18 * 60, rel=0.2)  # ≈ 18 min at 3 h
    with pytest.raises(ValueError, match="horizon"):
        ConvergenceAware(mtbf=HOUR, horizon=-1)


def test_smoothed_is_robust_and_detects_phase_changes() -> None:
    s = Smoothed()
    for _ in range(50):
        s.add(1.0)
    s.add(100.0)  # one spike
    assert s.value < 1.06
    shifted = [s.add(2.0) for _ in range(8)]
    assert any(shifted) and s.value == 2.0 and s.shifts == 1


def test_profiler_discounts_stalls_from_iteration_time() -> None:
    prof = Profiler()
    for _ in range(20):
        prof.record_iteration(0.01, persisting=False)
    prof.record_stall(0.05)
    prof.record_iteration(0.06, persisting=True)  # contains the stall
    prof.record_persist(0.5, 10**9)
    assert prof.iteration.value == pytest.approx(0.01)
    assert prof.iteration_while_persisting.value == pytest.approx(0.01)
    assert prof.stall.value == 0.05 and prof.bandwidth.value == pytest.approx(2e9)
    assert prof.slowdown == 0.0


def test_profiler_discounts_memory_snapshot_stalls_without_counting_them_as_checkpoints() -> None:
    prof = Profiler()
    prof.record_memory_stall(0.5)  # the first memory snapshot: creating the region and the copy
    prof.record_iteration(0.51, persisting=False)
    assert prof.iteration.value == pytest.approx(0.01)  # the session's first sample is training only
    prof.begin_checkpoint()
    prof.record_stall(0.005)
    prof.record_iteration(0.015, persisting=True)
    prof.record_memory_stall(0.02)  # a memory snapshot while the persist runs, and its fence wait
    prof.record_memory_stall(0.01)
    prof.record_iteration(0.04, persisting=True)
    prof.record_iteration(0.01, persisting=False)
    assert prof.iteration_while_persisting.value == pytest.approx(0.01)
    assert prof.stall.count == 1 and prof.stall.value == 0.005  # memory stalls are no checkpoint's stall
    assert prof.checkpoint_cost.value == pytest.approx(0.005)  # nor part of the checkpoint's cost


def test_profiler_measures_what_each_checkpoint_cost() -> None:
    """Stall plus the extra time of the iterations the persist overlapped, closed by the first clean iteration."""
    prof = Profiler()
    for _ in range(20):
        prof.record_iteration(0.1, persisting=False)
    prof.begin_checkpoint()
    prof.record_stall(0.005)
    prof.record_iteration(0.155, persisting=True)  # the stall, then the deferred copy: +50 ms
    prof.record_iteration(0.11, persisting=True)  # the end of the persist: +10 ms
    assert math.isnan(prof.checkpoint_cost.value)  # still open
    prof.record_iteration(0.1, persisting=False)
    assert prof.checkpoint_cost.value == pytest.approx(0.065)
    prof.begin_checkpoint()
    prof.record_iteration(0.13, persisting=True)
    prof.begin_checkpoint()  # the next checkpoint closes the one still overlapping
    assert prof.checkpoint_cost.value == pytest.approx(0.065 + 0.3 * (0.03 - 0.065))


def test_overhead_plans_from_the_measured_cost_per_checkpoint() -> None:
    """A slowdown concentrated in one iteration: the measured cost, not the average slowdown, sets the interval."""
    ctx = DecisionContext(
        step=100,
        session_steps=100,
        steps_since_checkpoint=1,
        elapsed=10.0,
        seconds_since_checkpoint=0.1,
        iteration_time=0.1,
        iteration_time_while_persisting=0.13,
        stall=0.005,
        persist_time=0.15,
        bytes_per_checkpoint=1,
        persist_in_flight=False,
        checkpoint_cost=0.065,
    )
    policy = Overhead(p=0.05)
    policy.should_save(ctx)
    assert policy.cost(ctx) == 0.065  # the model alone would say 5 ms + 150 ms · 0.3/1.3 ≈ 40 ms
    assert policy.interval == math.ceil(0.065 / (0.9 * 0.05 * 0.1))
    assert "cost per checkpoint 65.0 ms" in policy.reason
