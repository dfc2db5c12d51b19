"""The Monte Carlo failure simulator: validated against Daly's analytic model, then used to compare policies."""

from __future__ import annotations

import math

import numpy as np
import pytest

from checkfreq.policies.intervals import daly_waste, exact_optimum
from checkfreq.policies.losscurve import LossCurve
from checkfreq.tools import schedules
from checkfreq.tools.simulate import Schedule, Workload, relative_change, simulate

HOUR = 3600.0


def _blocking(mtbf: float = HOUR, stall: float = 300.0, restart: float = 120.0) -> tuple[Workload, float]:
    work = 24 * HOUR
    tau = work / round(work / exact_optimum(stall, mtbf))
    return Workload(work=work, iteration=1.0, stall=stall, persist=0.0, restart=restart, mtbf=mtbf), tau


def test_mean_waste_agrees_with_daly_analytic_within_one_percent() -> None:
    wl, tau = _blocking()
    result = simulate(wl, {"daly": Schedule(np.arange(tau, wl.work - 1, tau))}, runs=4000, seed=7)[0]
    analytic = daly_waste(tau, wl.stall, wl.mtbf, wl.restart)
    standard_error = result.overhead_std / math.sqrt(result.runs) / wl.work
    assert standard_error < 0.003 * analytic  # the 1 % check is meaningful at this sample size
    assert result.overhead / wl.work == pytest.approx(analytic, rel=0.01)


def test_common_random_numbers_make_identical_schedules_identical() -> None:
    wl, tau = _blocking()
    grid = Schedule(np.arange(tau, wl.work - 1, tau))
    a, b = simulate(wl, {"a": grid, "b": grid}, runs=300, seed=3)
    assert (a.overhead, a.failures) == (b.overhead, b.failures)
    c = simulate(wl, {"a": grid}, runs=300, seed=4)[0]
    assert c.overhead != a.overhead


def test_persist_lag_loses_the_checkpoint_in_flight() -> None:
    base = dict(work=24 * HOUR, iteration=1.0, stall=1.0, restart=0.0, mtbf=2 * HOUR)
    per_failure = []
    for persist in (0.0, 599.0):
        wl = Workload(persist=persist, **base)
        r = simulate(wl, {"ten min": schedules.every(wl, 600.0)}, runs=1000)[0]
        per_failure.append(r.lost / r.failures)
    assert per_failure[0] == pytest.approx(300.0, rel=0.05)  # half an interval
    # plus the checkpoint in flight, except in the first interval after a restart (none is in flight then)
    in_flight = math.exp(-600.0 / (2 * HOUR))
    assert per_failure[1] - per_failure[0] == pytest.approx(600.0 * in_flight, rel=0.05)


def test_checkpoint_waits_for_previous_persist() -> None:
    wl = Workload(work=HOUR, iteration=1.0, stall=1.0, persist=100.0, restart=0.0, mtbf=1e12)
    result = simulate(wl, {"dense": schedules.every(wl, 10.0)}, runs=5)[0]
    # 359 checkpoints plus the final one; each after the first waits 90 s; the last persist is waited for
    assert result.stall == pytest.approx(1 + 359 * 91 + 100)
    assert result.failures == 0 and result.checkpoints == 360


def test_nonhomogeneous_rate_and_failures_during_recovery() -> None:
    base = dict(work=24 * HOUR, iteration=1.0, stall=10.0, persist=0.0, restart=60.0)
    sched = {"hourly": schedules.every(Workload(mtbf=HOUR, **base), HOUR)}
    low = simulate(Workload(mtbf=4 * HOUR, **base), sched, runs=2000)[0].failures
    high = simulate(Workload(mtbf=2 * HOUR, **base), sched, runs=2000)[0].failures
    mixed = simulate(Workload(mtbf=4 * HOUR, rate_changes=((12 * HOUR, 2.0),), **base), sched, runs=2000)[0].failures
    assert low < mixed < high
    assert mixed == pytest.approx((low + high) / 2, rel=0.1)
    slow_restart = Workload(mtbf=4 * HOUR, **{**base, "restart": 4 * HOUR})  # restarts themselves fail
    r = simulate(slow_restart, sched, runs=500)[0]
    assert r.recovery / r.failures == pytest.approx(4 * HOUR * (math.e - 1), rel=0.1)


def test_early_termination_shortens_runs() -> None:
    base = dict(work=24 * HOUR, iteration=1.0, stall=30.0, persist=60.0, restart=120.0, mtbf=4 * HOUR)
    full = Workload(**base)
    stopped = Workload(stop_probability=1.0, **base)
    sched = {"young": schedules.young_daly(full)}
    assert simulate(stopped, sched, runs=500)[0].overhead < 0.65 * simulate(full, sched, runs=500)[0].overhead


WORKED = Workload(
    work=24 * HOUR,
    iteration=1.0,
    stall=30.0,
    persist=60.0,
    restart=120.0,
    mtbf=4 * HOUR,
    gpus=8,
    epoch=2 * HOUR,
    loss=LossCurve(a=0.2, b=120.0, w0=360.0, c=0.5),
)


def test_convergence_aware_lowers_value_weighted_overhead_against_young() -> None:
    placed = {
        "young": schedules.young_daly(WORKED, "young"),
        "beta=1": schedules.convergence_aware(WORKED, 1.0),
        "beta=0.5": schedules.convergence_aware(WORKED, 0.5),
        "epoch": schedules.epoch_level(WORKED),
    }
    results = simulate(WORKED, placed, runs=2000, seed=0)
    change = relative_change(results, "young")
    young = results[0]
    assert young.overhead / 60 == pytest.approx(116, rel=0.05)
    assert change["epoch"][0] == pytest.approx(3.0, rel=0.15)  # Young is about -75 % against epoch-level
    time_1, j_1 = change["beta=1"]
    time_half, j_half = change["beta=0.5"]
    assert j_1 == pytest.approx(-0.39, abs=0.05) and time_1 == pytest.approx(0.75, abs=0.12)
    assert j_half == pytest.approx(-0.32, abs=0.05) and time_half == pytest.approx(0.17, abs=0.08)
    assert young.gpu_hours == pytest.approx(young.overhead * 8 / 3600)


def test_published_baselines_and_invalid_workloads() -> None:
    cf = schedules.checkfreq_published(WORKED)
    assert not cf.absolute and cf.points[0] == 60.0 and np.all(np.diff(np.diff(cf.points)) >= 0)
    assert schedules.coci_published(WORKED, unit=1.0).points.size == 0  # in seconds it never checkpoints
    assert schedules.coci_published(WORKED, unit=HOUR).points.size > 500  # in hours, hundreds of times
    with pytest.raises(ValueError, match="mtbf"):
        Workload(work=1.0, iteration=1.0, stall=1.0, persist=1.0, restart=1.0, mtbf=0.0)
    no_curve = Workload(work=1.0, iteration=1.0, stall=1.0, persist=1.0, restart=1.0, mtbf=1.0)
    with pytest.raises(ValueError, match="loss curve"):
        schedules.convergence_aware(no_curve)
