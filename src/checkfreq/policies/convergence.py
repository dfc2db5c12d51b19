"""Convergence-aware placement: denser checkpoints early, sparser late, from an online fit of the loss
curve (docs/algorithms.md §3)."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from checkfreq.errors import InvalidArgumentError
from checkfreq.policies.base import (
    DecisionContext,
    check_params,
    measured,
    params_of,
    state_count,
    state_number,
    state_numbers,
    state_text,
)
from checkfreq.policies.failures import YoungDaly
from checkfreq.policies.intervals import convergence_interval, place_optimal
from checkfreq.policies.losscurve import LossCurve, fit_power_law

log = logging.getLogger("checkfreq.policies")


@dataclass
class ConvergenceAware:
    """Denser checkpoints early, sparser late: lost progress valued by what it bought (docs/algorithms.md §3).

    Fits ``L = a + b·(step + w0)^(−c)`` to the losses passed to ``step(loss=…)`` every
    ``refit_every`` steps (every tenth of the steps so far, later on) and adopts a new fit only when
    its value weight ``ω`` moved by more than ``replan_tolerance``. The interval at the current step is the closed form
    ``sqrt(2·C_b·M / ω^β)`` clamped to ``[max(t_i, C_p), M]``; with ``exact=True`` the remaining
    checkpoints are placed by the dynamic program instead. ``horizon`` is the planned training
    time in seconds (converted to steps with the measured iteration time). Until a fit exists it
    behaves like :class:`YoungDaly`.
    """

    mtbf: float
    horizon: float
    beta: float = 1.0
    exact: bool = False
    refit_every: int = 50
    replan_tolerance: float = 0.1
    max_points: int = 2048
    """Losses kept (halving the resolution when exceeded)."""
    fit_points: int = 256
    interval: int = field(default=0, init=False)
    reason: str = field(default="no loss fit yet", init=False)
    curve: LossCurve | None = field(default=None, init=False)
    _fallback: YoungDaly = field(init=False, repr=False)
    _steps: list[float] = field(default_factory=list, init=False, repr=False)
    _losses: list[float] = field(default_factory=list, init=False, repr=False)
    _stride: int = field(default=1, init=False, repr=False)
    _next_fit: int = field(default=0, init=False, repr=False)
    _plan: np.ndarray | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("mtbf", "horizon"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise InvalidArgumentError(
                    f"ConvergenceAware: {name} must be a positive number of seconds, got {value}"
                )
        if not (self.beta >= 0 and math.isfinite(self.beta)):
            raise InvalidArgumentError(f"ConvergenceAware: beta must be >= 0, got {self.beta}")
        if self.refit_every < 1 or self.max_points < 16 or not self.replan_tolerance > 0:
            raise InvalidArgumentError(
                "ConvergenceAware: need refit_every >= 1, max_points >= 16, replan_tolerance > 0"
            )
        self._fallback = YoungDaly(self.mtbf)

    def should_save(self, ctx: DecisionContext) -> bool:
        self._fallback.observe(ctx)
        if ctx.loss is not None and math.isfinite(ctx.loss):
            self._record(ctx.step, ctx.loss)
        if ctx.step >= self._next_fit and measured(ctx.iteration_time) and measured(ctx.stall):
            self._next_fit = ctx.step + max(self.refit_every, ctx.step // 10)  # refits get rarer as data accrue
            self._refit(ctx)
        if self.curve is None:
            self.interval, self.reason = self._fallback.interval, f"no loss fit yet: {self._fallback.reason}"
            return self._fallback.should_save(ctx)
        if not (self._fallback.ready(ctx) and measured(ctx.stall)):  # this session profiles first
            return False
        if self._plan is not None:
            last = ctx.step - ctx.steps_since_checkpoint
            due = self._plan[self._plan > last]
            self.interval = int(due[0] - last) if due.size else self.interval
        else:
            self.interval = self._closed_form(ctx, ctx.step - ctx.steps_since_checkpoint)
        return ctx.steps_since_checkpoint >= self.interval

    def state_dict(self) -> dict[str, Any]:
        """The fit, the loss history it is refitted from, the exact plan and the fallback's state, as JSON."""
        curve = None if self.curve is None else {k: float(v) for k, v in dataclasses.asdict(self.curve).items()}
        return {
            "params": params_of(self),
            "interval": self.interval,
            "reason": self.reason,
            "curve": curve,
            "steps": list(self._steps),
            "losses": list(self._losses),
            "stride": self._stride,
            "next_fit": self._next_fit,
            "plan": None if self._plan is None else [float(x) for x in self._plan],
            "fallback": self._fallback.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_params(self, state)
        steps, losses, curve, plan = (
            state_numbers(state, "steps"),
            state_numbers(state, "losses"),
            state.get("curve"),
            state.get("plan"),
        )
        if len(steps) != len(losses) or len(steps) > self.max_points:
            raise InvalidArgumentError(f"'steps' and 'losses' must be lists of equal length <= {self.max_points}")
        if curve is not None and not (isinstance(curve, Mapping) and set(curve) == {"a", "b", "w0", "c"}):
            raise InvalidArgumentError(f"'curve' must be null or {{a, b, w0, c}}, got {curve!r}")
        coefficients = [] if curve is None else [state_number(curve, k, low=-math.inf) for k in ("a", "b", "w0", "c")]
        if any(math.isnan(x) for x in coefficients):
            raise InvalidArgumentError(f"'curve' coefficients must be numbers, got {curve!r}")
        fit = LossCurve(*coefficients) if coefficients else None
        placed = None if plan is None else np.asarray(state_numbers(state, "plan"))
        fallback, stride = YoungDaly(self.mtbf), state_count(state, "stride")
        if not isinstance(state.get("fallback"), Mapping) or stride < 1:
            raise InvalidArgumentError("ConvergenceAware's state needs 'fallback' and a 'stride' >= 1")
        fallback.load_state_dict(state["fallback"])
        self.interval, self.reason, next_fit = (
            state_count(state, "interval"),
            state_text(state, "reason"),
            state_count(state, "next_fit"),
        )
        self.curve, self._plan, self._fallback, self._stride, self._next_fit = fit, placed, fallback, stride, next_fit
        self._steps, self._losses = steps, losses

    def _record(self, step: int, loss: float) -> None:
        if step % self._stride:
            return
        self._steps.append(float(step))
        self._losses.append(loss)
        if len(self._steps) > self.max_points:  # keep memory bounded: halve the resolution
            self._steps, self._losses, self._stride = self._steps[::2], self._losses[::2], self._stride * 2

    def _units(self, ctx: DecisionContext) -> tuple[float, float, float, float]:
        """Horizon, stall, persist and MTBF in steps."""
        t_i = ctx.iteration_time
        persist = ctx.persist_time if measured(ctx.persist_time) else 0.0
        return self.horizon / t_i, ctx.stall / t_i, persist / t_i, self.mtbf / t_i

    def _closed_form(self, ctx: DecisionContext, position: int) -> int:
        assert self.curve is not None
        horizon, stall, persist, mtbf = self._units(ctx)
        return round(
            convergence_interval(
                position, self.curve, horizon, stall=stall, persist=persist, mtbf=mtbf, iteration=1.0, beta=self.beta
            )
        )

    def _refit(self, ctx: DecisionContext) -> None:
        steps, losses = np.asarray(self._steps), np.asarray(self._losses)
        if steps.size < 16:
            return
        bins = -(-steps.size // self.fit_points)  # average into at most fit_points bins: cheaper, less noisy
        usable = steps.size // bins * bins
        fit = fit_power_law(steps[:usable].reshape(-1, bins).mean(1), losses[:usable].reshape(-1, bins).mean(1))
        horizon = self._units(ctx)[0]
        if fit is None or (self.curve is not None and not self.curve.moved(fit, horizon, self.replan_tolerance)):
            return
        self.curve = fit
        if self.exact:
            self._plan = self._place_exact(ctx)
        k = self._closed_form(ctx, ctx.step)
        self.reason = (
            f"loss fit a={fit.a:.3g} b={fit.b:.3g} w0={fit.w0:.3g} c={fit.c:.3g}: "
            f"ω={fit.weight(ctx.step, horizon):.3g} "
            f"at step {ctx.step}, β={self.beta:g} → every {k} steps now"
            + (f" (exact placement, {self._plan.size} checkpoints left)" if self._plan is not None else "")
        )
        log.info("ConvergenceAware: replanned (%s)", self.reason)

    def _place_exact(self, ctx: DecisionContext) -> np.ndarray:
        assert self.curve is not None
        horizon, stall, persist, mtbf = self._units(ctx)
        step = max(persist, horizon / 2000.0, 1.0)
        grid = np.append(np.arange(0.0, horizon, step), horizon)
        placed = place_optimal(
            grid,
            stall=stall,
            persist=persist,
            restart=0.0,
            rate=np.full(grid.size, 1.0 / mtbf),
            weight=np.asarray(self.curve.weight(grid, horizon)),
            survival=np.ones(grid.size),
            window=max(int(4 * mtbf / step), 2),
        )
        return np.round(placed)
