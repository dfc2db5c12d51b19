"""Every worked number of docs/algorithms.md, recomputed by the code it describes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from checkfreq.policies import Overhead
from checkfreq.policies.intervals import (
    convergence_interval,
    daly,
    daly_waste,
    exact_optimum,
    overhead_steps,
    place,
    two_phase_interval,
    young,
)
from checkfreq.policies.losscurve import LossCurve
from checkfreq.tools.simulate import Schedule, Workload, simulate
from helpers import DOCS

DOC = " ".join((DOCS / "algorithms.md").read_text().split())
HOUR, MIN = 3600.0, 60.0


def says(*fragments: str) -> None:
    for fragment in fragments:
        assert fragment in DOC, f"docs/algorithms.md does not say {fragment!r}"


def test_section_1_overhead_bound_and_retuning() -> None:
    p, target = 0.035, Overhead.target
    k = overhead_steps(0.1, 0.04, 0.6, target * p)
    says(
        "0.9·p·t_i",
        f"`ceil({0.04 / (target * p * 0.1):.2f})` = {k}, so `k` = {k}",
        f"an overhead of 0.04/{k * 0.1:g} = {0.04 / (k * 0.1):.2%}".replace("%", " %"),
    )
    assert target == 0.9 and Overhead().window == 3 and Overhead().hysteresis == 0.3 and Overhead().warmup == 10
    published = [6 + 2 * n for n in range(4)]  # ceil(C_p / t_i) = 6, then +2 while a window is above p
    assert [0.04 / (q * 0.1) > p for q in published] == [True, True, True, False]
    says(
        f"starts at `k` = 6 (an overhead of {0.04 / 0.6:.2%})".replace("%", " %"), "climbs 8, 10, 12 (5 %, 4 %, 3.33 %)"
    )
    correction = 0.05 / (target * p)
    says(
        f"correction to 0.05/(0.9·0.035) = {correction:.3f}",
        f"= {overhead_steps(0.1, 0.04 * correction, 0.6, target * p)}.",
    )
    says("a plan of 17 is ignored (22.1 ≥ 21) and a plan of 16 is adopted (20.8 < 21)")
    assert 17 * 1.3 >= 21 > 16 * 1.3


def test_section_2_young_daly_and_the_exact_optimum() -> None:
    for hours, label in ((24, "24 h"), (6, "6 h"), (0.25, "15 min")):
        m = hours * HOUR
        says(
            f"| {label} | {young(300, m) / MIN:.2f} min | {daly(300, m) / MIN:.2f} min | "
            f"{exact_optimum(300, m) / MIN:.2f} min |"
        )
    says(
        f"Young gives {young(30, 4 * HOUR) / MIN:.2f} min, Daly {two_phase_interval(30, 60, 4 * HOUR) / MIN:.2f} min",
        f"Daly gives {two_phase_interval(0.6, 60, 4 * HOUR) / MIN:.2f} min",
    )


WORKED = LossCurve(a=0.2, b=2.0 * 60.0, w0=0.1 * HOUR, c=0.5)  # L = 0.2 + 2·(w + 0.1)^(−0.5), w in hours
HORIZON = 24 * HOUR


def _interval(t: float, beta: float) -> float:
    return convergence_interval(t, WORKED, HORIZON, stall=30.0, persist=60.0, mtbf=4 * HOUR, iteration=1.0, beta=beta)


def test_section_3_worked_example() -> None:
    says(
        f"`L(0)` = {WORKED.value(0.0):.4f}",
        f"`L(T)` = {WORKED.value(HORIZON):.4f}",
        f"`r̄` = {WORKED.mean_rate(HORIZON) * HOUR:.4f} per hour",
    )
    says(
        f"= {young(30, 4 * HOUR):.1f} s, {_interval(0.0, 0.0) / MIN:.1f} min in whole steps "
        f"({len(place(lambda t: _interval(t, 0.0), HORIZON))} checkpoints inside the run)"
    )
    for hour in (0, 1, 3, 12, 23):
        t = hour * HOUR
        says(
            f"| {hour} h | {float(WORKED.weight(t, HORIZON)):.3f} | {round(_interval(t, 1.0) / MIN, 2):g} min | "
            f"{round(_interval(t, 0.5) / MIN, 2):g} min |"
        )
    says(
        f"`β = 1` places {len(place(lambda t: _interval(t, 1.0), HORIZON))} checkpoints inside the run, "
        f"`β = 0.5` places {len(place(lambda t: _interval(t, 0.5), HORIZON))}"
    )


def test_section_4_simulator_against_dalys_model() -> None:
    work = 24 * HOUR
    optimum = exact_optimum(300.0, HOUR)
    n = round(work / optimum)
    tau = work / n
    analytic = daly_waste(tau, 300.0, HOUR, 120.0)
    wl = Workload(work=work, iteration=1.0, stall=300.0, persist=0.0, restart=120.0, mtbf=HOUR)
    simulated = simulate(wl, {"daly": Schedule(np.arange(tau, work - 1, tau))}, runs=4000, seed=7)[0].overhead / work
    says(
        f"The exact optimum is {optimum:.1f} s",
        f"{n} equal intervals of {tau:.1f} s",
        f"waste of {analytic:.2%} of `W`".replace("%", " %"),
        f"(seed 7) waste {simulated:.2%}".replace("%", " %"),
        f"within {math.ceil(abs(simulated / analytic - 1) * 1000) / 10:g} % of the model",
    )
    assert simulated == pytest.approx(analytic, rel=0.01)
