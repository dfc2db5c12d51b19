"""Closed-form intervals, the Lambert-W optimum, the loss-curve fit and the placements."""

from __future__ import annotations

import math

import numpy as np
import pytest

from checkfreq.policies.intervals import (
    convergence_interval,
    daly,
    daly_waste,
    exact_optimum,
    expected_cost,
    lambert_w0,
    overhead_steps,
    place,
    place_optimal,
    two_phase_interval,
    young,
)
from checkfreq.policies.losscurve import LossCurve, fit_power_law

MIN, HOUR = 60.0, 3600.0


@pytest.mark.parametrize(
    ("mtbf", "young_min", "daly_min"),
    [(24 * HOUR, 120.0, 116.69), (6 * HOUR, 60.0, 56.71), (15 * MIN, 12.25, 9.14)],
)
def test_young_and_daly_check_values(mtbf: float, young_min: float, daly_min: float) -> None:
    assert young(5 * MIN, mtbf) / MIN == pytest.approx(young_min, abs=0.01)
    assert daly(5 * MIN, mtbf) / MIN == pytest.approx(daly_min, abs=0.01)


def test_exact_optimum_check_value_and_large_cost() -> None:
    assert exact_optimum(5 * MIN, 15 * MIN) / MIN == pytest.approx(9.17, abs=0.01)
    assert daly(3 * HOUR, 1 * HOUR) == 1 * HOUR


@pytest.mark.parametrize("x", [-1 / math.e, -0.3, -0.1, 0.0, 0.5, 3.0, 1e6])
def test_lambert_w0_inverts_w_exp_w(x: float) -> None:
    w = lambert_w0(x)
    assert w >= -1.0
    assert w * math.exp(w) == pytest.approx(x, abs=1e-12, rel=1e-12)


@pytest.mark.parametrize(("stall", "mtbf"), [(300.0, 900.0), (30.0, 4 * HOUR), (5.0, 24 * HOUR), (600.0, 700.0)])
def test_lambert_w_optimum_matches_numeric_minimisation(stall: float, mtbf: float) -> None:
    def waste(tau: float) -> float:
        return mtbf * math.expm1((tau + stall) / mtbf) / tau

    lo, hi = stall * 1e-3, 3 * mtbf  # golden-section search: the waste is unimodal in tau
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        lo, hi = (lo, b) if waste(a) < waste(b) else (a, hi)
    assert exact_optimum(stall, mtbf) == pytest.approx((lo + hi) / 2, rel=1e-6)
    best = daly_waste(exact_optimum(stall, mtbf), stall, mtbf, 60.0)
    assert best <= daly_waste(daly(stall, mtbf), stall, mtbf, 60.0) + 1e-12


def test_two_phase_interval_never_shorter_than_persist() -> None:
    assert two_phase_interval(1.0, 600.0, 4 * HOUR) == 600.0
    assert two_phase_interval(30.0, 60.0, 4 * HOUR, method="young") == pytest.approx(young(30.0, 4 * HOUR))
    with pytest.raises(ValueError, match="method"):
        two_phase_interval(30.0, 60.0, 4 * HOUR, method="magic")


def test_overhead_steps_bounds() -> None:
    assert overhead_steps(1.0, 30.0, 60.0, 0.035) == math.ceil(30 / 0.035)
    assert overhead_steps(1.0, 0.6, 60.0, 0.035) == 60  # persist must keep up
    assert overhead_steps(1.0, 0.0, 0.0, 0.035) == 1
    with pytest.raises(ValueError, match="p must"):
        overhead_steps(1.0, 1.0, 1.0, 0.0)


@pytest.mark.parametrize("call", [lambda: young(0.0, 1.0), lambda: daly(1.0, -1.0), lambda: lambert_w0(-1.0)])
def test_bad_parameters_raise(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        call()


# The worked example of docs/algorithms.md §3, with w in seconds.
WORKED = LossCurve(a=0.2, b=2.0 * 60.0, w0=0.1 * HOUR, c=0.5)
HORIZON = 24 * HOUR


def _interval(t: float, beta: float = 1.0) -> float:
    return convergence_interval(t, WORKED, HORIZON, stall=30.0, persist=60.0, mtbf=4 * HOUR, iteration=1.0, beta=beta)


@pytest.mark.parametrize(("hour", "minutes"), [(0, 1.4), (1, 8.3), (3, 18.0), (12, 50.0), (23, 81.0)])
def test_worked_example_intervals(hour: float, minutes: float) -> None:
    assert _interval(hour * HOUR) / MIN == pytest.approx(minutes, rel=0.10)


def test_worked_example_counts() -> None:
    assert len(place(_interval, HORIZON)) == pytest.approx(52, rel=0.10)
    assert len(place(lambda t: _interval(t, beta=0.0), HORIZON)) == pytest.approx(93, rel=0.10)
    assert _interval(5 * HOUR, beta=0.0) / MIN == pytest.approx(15.5, abs=0.05)


def test_weight_has_mean_one_over_the_horizon() -> None:
    grid = np.linspace(0.0, HORIZON, 200_001)
    assert np.trapezoid(WORKED.weight(grid, HORIZON), grid) / HORIZON == pytest.approx(1.0, rel=1e-3)
    assert WORKED.cumulative_weight(HORIZON, HORIZON) == pytest.approx(HORIZON)


def test_exact_placement_beats_closed_form_and_uniform() -> None:
    grid = np.append(np.arange(0.0, HORIZON, 60.0), HORIZON)
    model = dict(
        stall=30.0,
        persist=60.0,
        restart=120.0,
        rate=np.full(grid.size, 1 / (4 * HOUR)),
        weight=WORKED.weight(grid, HORIZON),
        survival=np.ones(grid.size),
    )
    optimal = place_optimal(grid, **model, window=400)
    closed = place(_interval, HORIZON)
    uniform = place(lambda t: _interval(t, beta=0.0), HORIZON)
    j_opt, j_closed, j_young = (expected_cost(p, grid, **model) for p in (optimal, closed, uniform))
    assert j_opt <= j_closed * 1.001
    assert j_closed < 0.8 * j_young
    assert len(optimal) == pytest.approx(len(closed), rel=0.15)


def test_fit_recovers_the_worked_curve_from_early_noisy_data() -> None:
    w = np.linspace(0.0, 3 * HOUR, 400)
    noisy = WORKED.value(w) + np.random.default_rng(0).normal(0.0, 0.02, w.size)
    fit = fit_power_law(w, noisy)
    assert fit is not None
    probe = np.array([0.0, 1.0, 3.0]) * HOUR
    assert fit.weight(probe, HORIZON) == pytest.approx(WORKED.weight(probe, HORIZON), rel=0.05)
    assert not WORKED.moved(fit, HORIZON, tolerance=0.1)


def test_fit_declines_flat_or_short_data() -> None:
    assert fit_power_law(np.arange(5.0), np.ones(5)) is None
    assert fit_power_law(np.arange(50.0), np.linspace(1.0, 2.0, 50)) is None
