"""Loss-curve model ``L(w) = a + b·(w + w0)^(−c)``, its online fit, and the value weight it implies."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from checkfreq.errors import InvalidArgumentError

_EXPONENTS = np.geomspace(0.05, 4.0, 48)
_OFFSETS = np.geomspace(1e-4, 1.0, 33)  # as fractions of the observed span of w


@dataclass(frozen=True)
class LossCurve:
    """A decreasing power law in training position ``w`` (any unit, used consistently)."""

    a: float
    b: float
    w0: float
    c: float

    def __post_init__(self) -> None:
        if not (self.b > 0 and self.w0 > 0 and self.c > 0):
            raise InvalidArgumentError(f"LossCurve needs b, w0, c > 0, got b={self.b}, w0={self.w0}, c={self.c}")

    def value(self, w: float | np.ndarray) -> float | np.ndarray:
        return self.a + self.b * (np.asarray(w) + self.w0) ** (-self.c)

    def slope(self, w: float | np.ndarray) -> float | np.ndarray:
        """``|L'(w)|``, the rate of progress."""
        return self.b * self.c * (np.asarray(w) + self.w0) ** (-self.c - 1.0)

    def mean_rate(self, horizon: float) -> float:
        """``r̄ = (L(0) − L(T)) / T``."""
        if not horizon > 0:
            raise InvalidArgumentError(f"horizon must be positive, got {horizon!r}")
        return float(self.value(0.0) - self.value(horizon)) / horizon

    def weight(self, w: float | np.ndarray, horizon: float) -> float | np.ndarray:
        """Value weight ``ω(w) = |L'(w)| / r̄``: mean 1 over ``[0, horizon]``."""
        return self.slope(w) / self.mean_rate(horizon)

    def cumulative_weight(self, w: float | np.ndarray, horizon: float) -> float | np.ndarray:
        """``∫_0^w ω`` = ``(L(0) − L(w)) / r̄``: the value of the progress made up to ``w``."""
        return (self.value(0.0) - self.value(w)) / self.mean_rate(horizon)

    def moved(self, other: LossCurve, horizon: float, tolerance: float = 0.1) -> bool:
        """Whether the weights of two fits differ by more than ``tolerance`` anywhere on the horizon."""
        probe = np.linspace(0.0, horizon, 25)
        mine, theirs = self.weight(probe, horizon), other.weight(probe, horizon)
        return bool(np.max(np.abs(np.log(theirs / mine))) > math.log1p(tolerance))


def fit_power_law(w: np.ndarray, loss: np.ndarray) -> LossCurve | None:
    """Least-squares fit of :class:`LossCurve`; ``None`` while the data show no decrease.

    For each exponent ``c`` and offset ``w0`` on a grid the model is linear in ``a, b``, so the
    fit is a closed-form regression per grid point, then a finer grid around the best one.
    """
    w = np.asarray(w, dtype=float)
    loss = np.asarray(loss, dtype=float)
    keep = np.isfinite(w) & np.isfinite(loss)
    w, loss = w[keep], loss[keep]
    if len(w) < 8 or np.ptp(w) <= 0:
        return None
    coarse = _grid_fit(w, loss, _EXPONENTS, _OFFSETS * float(np.ptp(w)))
    if coarse is None:
        return None
    fit: LossCurve | None = coarse
    for spread in (0.2, 0.04):  # zoom in twice around the best point
        assert fit is not None
        fit = _grid_fit(
            w,
            loss,
            fit.c * np.exp(np.linspace(-spread, spread, 15)),
            fit.w0 * np.exp(np.linspace(-3 * spread, 3 * spread, 15)),
        )
    return fit


def _regress(
    w: np.ndarray, loss: np.ndarray, cs: np.ndarray, w0s: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Closed-form ``a, b`` and squared error for every ``(c, w0)`` pair on the grid."""
    c = cs[:, None, None]
    w0 = w0s[None, :, None]
    x = (w[None, None, :] + w0) ** (-c)
    xm = x.mean(axis=-1, keepdims=True)
    lm = loss.mean()
    xc = x - xm
    var = np.sum(xc * xc, axis=-1)
    b = np.sum(xc * (loss - lm), axis=-1) / np.where(var > 0, var, np.inf)
    a = lm - b * xm[..., 0]
    sse = np.sum((a[..., None] + b[..., None] * x - loss) ** 2, axis=-1)
    sse = np.where(b > 0, sse, np.inf)
    return a, b, sse


def _grid_fit(w: np.ndarray, loss: np.ndarray, cs: np.ndarray, w0s: np.ndarray) -> LossCurve | None:
    a, b, sse = _regress(w, loss, cs, w0s)
    if not np.isfinite(sse).any():
        return None
    i, j = np.unravel_index(int(np.argmin(sse)), sse.shape)
    return LossCurve(a=float(a[i, j]), b=float(b[i, j]), w0=float(w0s[j]), c=float(cs[i]))


def fit_exponential(w: np.ndarray, loss: np.ndarray) -> tuple[float, float]:
    """``(θ1, θ2)`` of ``L(w) = exp(θ1·w + θ2)`` by least squares on ``log L`` (COCI's model)."""
    w = np.asarray(w, dtype=float)
    loss = np.asarray(loss, dtype=float)
    if len(w) < 2 or np.any(loss <= 0):
        raise InvalidArgumentError("fit_exponential needs at least two points with positive loss")
    theta1, theta2 = np.polyfit(w, np.log(loss), 1)
    return float(theta1), float(theta2)
