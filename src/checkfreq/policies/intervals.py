"""Closed-form checkpoint intervals and placements (pure math, seconds throughout).

Notation follows docs/algorithms.md: ``stall`` is the blocking cost ``C_b`` of one checkpoint,
``persist`` the background time ``C_p`` until it is durable, ``restart`` the cost ``R`` of coming
back after a failure, ``mtbf`` the job's mean time between failures ``M``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from checkfreq.errors import InvalidArgumentError
from checkfreq.policies.losscurve import LossCurve


def _positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not (ok and math.isfinite(value)):
        bound = "non-negative" if allow_zero else "positive"
        raise InvalidArgumentError(f"{name} must be a {bound} finite number, got {value!r}")


def lambert_w0(x: float) -> float:
    """Principal branch of the Lambert W function, ``W0(x)`` for ``x >= -1/e`` (Halley's method)."""
    branch_point = -1.0 / math.e
    if not math.isfinite(x) or x < branch_point - 1e-15:
        raise InvalidArgumentError(f"lambert_w0 is defined for x >= -1/e, got {x!r}")
    if x <= branch_point:
        return -1.0
    if x < -0.25:  # series around the branch point
        q = math.sqrt(2.0 * (math.e * x + 1.0))
        w = -1.0 + q - q * q / 3.0 + 11.0 / 72.0 * q**3
    elif x < 3.0:
        w = math.log1p(x)
    else:
        w = math.log(x) - math.log(math.log(x))
    for _ in range(64):
        ew = math.exp(w)
        f = w * ew - x
        step = f / (ew * (w + 1.0) - (w + 2.0) * f / (2.0 * w + 2.0))
        w -= step
        if abs(step) <= 1e-15 * (1.0 + abs(w)):
            break
    return w


def young(stall: float, mtbf: float) -> float:
    """Young's first-order optimum ``sqrt(2·C·M)``."""
    _positive("stall", stall)
    _positive("mtbf", mtbf)
    return math.sqrt(2.0 * stall * mtbf)


def daly(stall: float, mtbf: float) -> float:
    """Daly's higher-order optimum (2006); ``M`` once the checkpoint costs ``2M`` or more."""
    _positive("stall", stall)
    _positive("mtbf", mtbf)
    if stall >= 2.0 * mtbf:
        return mtbf
    ratio = stall / (2.0 * mtbf)
    return math.sqrt(2.0 * stall * mtbf) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - stall


def exact_optimum(stall: float, mtbf: float) -> float:
    """Exact minimiser of Daly's full model: ``M·(1 + W0(−e^(−(1 + C/M))))``."""
    _positive("stall", stall)
    _positive("mtbf", mtbf)
    return mtbf * (1.0 + lambert_w0(-math.exp(-(1.0 + stall / mtbf))))


def daly_waste(interval: float, stall: float, mtbf: float, restart: float) -> float:
    """Expected wasted fraction of Daly's full model: ``M·e^(R/M)·(e^((τ+C)/M) − 1)/τ − 1``.

    Exact for Poisson failures, a blocking checkpoint after every ``τ`` of work (including the
    last), failures during checkpoints and restarts, and a roll-back to the last checkpoint.
    """
    _positive("interval", interval)
    _positive("mtbf", mtbf)
    _positive("stall", stall, allow_zero=True)
    _positive("restart", restart, allow_zero=True)
    return mtbf * math.exp(restart / mtbf) * math.expm1((interval + stall) / mtbf) / interval - 1.0


def young_waste(interval: float, stall: float, mtbf: float, restart: float) -> float:
    """First-order expected overhead fraction ``C/τ + (τ/2 + R)/M``."""
    _positive("interval", interval)
    _positive("mtbf", mtbf)
    return stall / interval + (interval / 2.0 + restart) / mtbf


def two_phase_interval(stall: float, persist: float, mtbf: float, *, method: str = "daly") -> float:
    """Failure-optimal interval when only the stall blocks: the optimum for ``C_b``, at least ``C_p``.

    A checkpoint cannot start before the previous one is durable, hence ``τ >= persist``.
    ``method`` is ``"young"``, ``"daly"`` or ``"exact"``.
    """
    formulas: dict[str, Callable[[float, float], float]] = {
        "young": young,
        "daly": daly,
        "exact": exact_optimum,
    }
    if method not in formulas:
        raise InvalidArgumentError(f"method must be one of {sorted(formulas)}, got {method!r}")
    _positive("persist", persist, allow_zero=True)
    return max(formulas[method](stall, mtbf), persist)


def overhead_steps(iteration: float, cost: float, persist: float, p: float) -> int:
    """Fewest steps between checkpoints so that persist keeps up and ``cost`` stays ≤ ``p`` of the run.

    ``k = max(ceil(C_p / t_i), ceil(cost / (p·t_i)), 1)``, where ``cost`` is what one checkpoint costs
    the training loop (its stall plus the slowdown of the iterations that overlap its persist).
    """
    _positive("iteration", iteration)
    _positive("cost", cost, allow_zero=True)
    _positive("persist", persist, allow_zero=True)
    if not 0 < p < 1:
        raise InvalidArgumentError(f"p must lie in (0, 1), got {p!r}")
    eps = 1e-9  # keep exact ratios (60/1) from rounding up to the next step
    return max(math.ceil(persist / iteration - eps), math.ceil(cost / (p * iteration) - eps), 1)


def convergence_interval(
    position: float,
    curve: LossCurve,
    horizon: float,
    *,
    stall: float,
    persist: float,
    mtbf: float,
    iteration: float,
    beta: float = 1.0,
) -> float:
    """Value-weighted interval ``sqrt(2·C_b / (λ·ω(t)^β))``, clamped to ``[max(t_i, C_p), M]``.

    ``β = 0`` is Young's interval, ``β = 1`` the value-weighted optimum, ``β ≈ 2`` close to COCI's
    equal-progress rule. The result is a whole number of iterations.
    """
    _positive("iteration", iteration)
    if not (beta >= 0 and math.isfinite(beta)):
        raise InvalidArgumentError(f"beta must be a non-negative number, got {beta!r}")
    weight = max(curve.weight(position, horizon), 1e-300)
    raw = math.sqrt(2.0 * stall * mtbf / weight**beta)
    lo = max(iteration, persist)
    clamped = min(max(raw, lo), max(mtbf, lo))
    return max(round(clamped / iteration), 1) * iteration


def place(interval_at: Callable[[float], float], horizon: float) -> np.ndarray:
    """Checkpoint positions ``t_{n+1} = t_n + τ(t_n)`` strictly inside ``(0, horizon)``."""
    _positive("horizon", horizon)
    points: list[float] = []
    t = 0.0
    while True:
        step = interval_at(t)
        if not step > 0:
            raise InvalidArgumentError(f"interval must be positive, got {step!r} at {t}")
        t += step
        if t >= horizon:
            return np.asarray(points, dtype=float)
        points.append(t)


def expected_cost(
    positions: np.ndarray,
    grid: np.ndarray,
    *,
    stall: float,
    persist: float,
    restart: float,
    rate: np.ndarray,
    weight: np.ndarray,
    survival: np.ndarray,
) -> float:
    """Value-weighted overhead ``J`` of a placement, evaluated on ``grid`` (docs/algorithms.md §3).

    ``rate``, ``weight`` and ``survival`` are ``λ``, ``ω`` and ``S`` sampled on ``grid``; each
    position is snapped to the nearest grid point.
    """
    a, b, d = _prefix_integrals(grid, rate, weight, survival)
    idx = np.unique(np.clip(np.searchsorted(grid, positions), 0, len(grid) - 1))
    idx = idx[(idx > 0) & (idx < len(grid) - 1)]
    bounds = np.concatenate(([0], idx, [len(grid) - 1]))
    lo, hi = bounds[:-1], bounds[1:]
    lag = np.where(lo == 0, 0.0, persist)
    loss = (a[hi] - a[lo]) - (grid[lo] - lag) * (b[hi] - b[lo]) + restart * (d[hi] - d[lo])
    return float(np.sum(survival[idx]) * stall + np.sum(loss))


def _prefix_integrals(
    grid: np.ndarray, rate: np.ndarray, weight: np.ndarray, survival: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Trapezoid prefix integrals ``A = ∫S·λ·ω·u``, ``B = ∫S·λ·ω``, ``D = ∫S·λ`` on ``grid``."""
    dx = np.diff(grid)

    def cumulative(f: np.ndarray) -> np.ndarray:
        return np.concatenate(([0.0], np.cumsum(0.5 * (f[1:] + f[:-1]) * dx)))

    slw = survival * rate * weight
    return cumulative(slw * grid), cumulative(slw), cumulative(survival * rate)


def place_optimal(
    grid: np.ndarray,
    *,
    stall: float,
    persist: float,
    restart: float,
    rate: np.ndarray,
    weight: np.ndarray,
    survival: np.ndarray,
    window: int = 400,
) -> np.ndarray:
    """Exact placement minimising ``J`` over checkpoints at ``grid`` points, by dynamic programming.

    ``F(j) = min_i F(i) + S(x_j)·C_b + [A(x_j) − A(x_i)] − (x_i − C_p)·[B(x_j) − B(x_i)] + R·[D(x_j) − D(x_i)]``
    with ``x_0 = 0`` (no persist lag there) and the last grid point the end of the run (no stall).
    Predecessors are searched over the previous ``window`` points, and gaps shorter than
    ``persist`` are not allowed. O(n·window).
    """
    grid = np.asarray(grid, dtype=float)
    n = len(grid)
    if n < 2 or np.any(np.diff(grid) <= 0) or grid[0] != 0.0:
        raise InvalidArgumentError("grid must start at 0 and increase strictly, with at least two points")
    if window < 1:
        raise InvalidArgumentError(f"window must be >= 1, got {window}")
    a, b, d = _prefix_integrals(grid, rate, weight, survival)
    best = np.full(n, np.inf)
    best[0] = 0.0
    parent = np.zeros(n, dtype=int)
    for j in range(1, n):
        i = np.arange(max(0, j - window), j)
        i = i[(grid[j] - grid[i] >= persist) | (i == 0)]
        lag = np.where(i == 0, 0.0, persist)
        cost = (
            best[i]
            + (a[j] - a[i])
            - (grid[i] - lag) * (b[j] - b[i])
            + restart * (d[j] - d[i])
            + (stall * survival[j] if j < n - 1 else 0.0)
        )
        k = int(np.argmin(cost))
        best[j], parent[j] = cost[k], i[k]
    chain = []
    j = parent[n - 1]
    while j > 0:
        chain.append(grid[j])
        j = parent[j]
    return np.asarray(chain[::-1], dtype=float)
