"""The failure-optimal interval of Young and Daly from a mean time between failures (docs/algorithms.md §2)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from checkfreq.errors import InvalidArgumentError
from checkfreq.policies.base import DecisionContext, check_params, measured, params_of, state_count, state_text
from checkfreq.policies.intervals import two_phase_interval

log = logging.getLogger("checkfreq.policies")


@dataclass
class YoungDaly:
    """Failure-optimal interval for a job MTBF: Daly's higher-order formula on the stall, at least the persist time.

    ``mtbf`` is the *job's* mean time between failures in seconds (``g`` workers of MTBF ``M_1``
    each give ``M_1 / g``). ``method``: ``"daly"`` (default), ``"young"`` or ``"exact"``.
    Every session profiles ``warmup`` steps first; until an interval is planned, a checkpoint
    every ``warmup`` steps measures the costs.
    """

    mtbf: float
    method: str = "daly"
    warmup: int = 10
    hysteresis: float = 0.1
    interval: int = field(default=0, init=False)
    reason: str = field(default="profiling", init=False)

    def __post_init__(self) -> None:
        if not (self.mtbf > 0 and math.isfinite(self.mtbf)):
            raise InvalidArgumentError(f"YoungDaly: mtbf must be a positive number of seconds, got {self.mtbf}")
        two_phase_interval(1.0, 0.0, 1.0, method=self.method)  # validates the method name
        if self.warmup < 1 or self.hysteresis < 0:
            raise InvalidArgumentError("YoungDaly: warmup must be >= 1 and hysteresis >= 0")

    def should_save(self, ctx: DecisionContext) -> bool:
        self.observe(ctx)
        return self.ready(ctx) and ctx.steps_since_checkpoint >= (self.interval or self.warmup)

    def ready(self, ctx: DecisionContext) -> bool:
        """Whether this session has profiled its iterations and no persist is in flight."""
        return not ctx.persist_in_flight and ctx.session_steps >= self.warmup and measured(ctx.iteration_time)

    def state_dict(self) -> dict[str, Any]:
        return {"params": params_of(self), "interval": self.interval, "reason": self.reason}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_params(self, state)
        self.interval, self.reason = state_count(state, "interval"), state_text(state, "reason")

    def observe(self, ctx: DecisionContext) -> None:
        if not (measured(ctx.iteration_time) and measured(ctx.stall)):
            return
        persist = ctx.persist_time if measured(ctx.persist_time) else 0.0
        tau = two_phase_interval(ctx.stall, persist, self.mtbf, method=self.method)
        k = max(round(tau / ctx.iteration_time), 1)
        if self.interval and abs(k - self.interval) <= self.hysteresis * self.interval:
            return
        self.reason = (
            f"{self.method} for MTBF {self.mtbf / 3600:.3g} h, stall {ctx.stall:.3g} s, persist {persist:.3g} s: "
            f"τ = {tau:.1f} s = {k} steps of {ctx.iteration_time * 1e3:.2f} ms"
        )
        log.info("YoungDaly: interval %d → %d steps (%s)", self.interval, k, self.reason)
        self.interval = k
