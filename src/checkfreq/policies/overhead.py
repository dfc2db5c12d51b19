"""CheckFreq's rule: the shortest interval whose measured cost stays under an overhead bound, retuned
as the measurements move (docs/algorithms.md §1)."""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from checkfreq.errors import InvalidArgumentError
from checkfreq.policies.base import (
    DecisionContext,
    check_params,
    finite_or_none,
    measured,
    params_of,
    state_count,
    state_number,
    state_numbers,
    state_text,
)
from checkfreq.policies.intervals import overhead_steps
from checkfreq.policies.profiler import interference

log = logging.getLogger("checkfreq.policies")


@dataclass
class _Cycles:
    """Detects checkpoints from the context and measures each checkpoint-to-checkpoint cycle, in
    seconds of training and checkpointing (the loop's other work between steps left out)."""

    last_since: int | None = None
    start_step: int | None = None
    start_time: float = 0.0
    closed: tuple[int, float] | None = None
    """The cycle that ended at this step, as ``(steps, seconds)``, if one did."""

    def observe(self, ctx: DecisionContext) -> bool:
        """Whether a checkpoint was taken since the previous call."""
        fresh = self.last_since is not None and ctx.steps_since_checkpoint <= self.last_since
        self.last_since = ctx.steps_since_checkpoint
        self.closed = None
        if not fresh:
            return False
        step = ctx.step - ctx.steps_since_checkpoint
        time = ctx.elapsed - ctx.seconds_since_checkpoint - (ctx.away - ctx.away_since_checkpoint)
        if self.start_step is not None and step > self.start_step and time > self.start_time:
            self.closed = (step - self.start_step, time - self.start_time)
        self.start_step, self.start_time = step, time
        return True


@dataclass
class Overhead:
    """Checkpoint as often as possible while checkpointing costs at most ``p`` of the run.

    CheckFreq done right (docs/algorithms.md §1): ``k = max(ceil(C_p / t_i), ceil(c / (p'·t_i)))``
    where ``c`` is what one checkpoint costs the loop — its stall plus the extra time of the
    iterations its persist overlapped, measured per checkpoint by the profiler — and ``p'``
    is ``target·p`` to leave room for noise. ``k`` follows the measured costs both ways, with
    hysteresis (it shrinks only when the plan falls below ``k / (1 + hysteresis)``). The overhead
    measured over each window of checkpoint cycles corrects the plan: above ``p`` it scales the
    cost up, below ``low·p`` it relaxes the correction. A budget keeps the whole-run promise: a
    checkpoint is deferred while the overhead spent so far plus the next one's cost would exceed
    ``p`` of the training time so far, and while the previous persist is still in flight.
    """

    p: float = 0.035
    warmup: int = 10
    """Steps profiled at the start of every session (run or restore) before its first checkpoint."""
    target: float = 0.9
    """Plan for ``target·p``, leaving the rest of the bound for noise."""
    low: float = 0.5
    hysteresis: float = 0.3
    window: int = 3
    """Cycles per verdict of measured overhead."""
    interval: int = field(default=0, init=False)
    """Current ``k`` (0 until the first checkpoint's cost is measured)."""
    reason: str = field(default="profiling", init=False)
    correction: float = field(default=1.0, init=False)
    _cycles: _Cycles = field(default_factory=_Cycles, init=False, repr=False)
    _window: deque[float] = field(default_factory=deque, init=False, repr=False)
    _why: str | None = field(default=None, init=False, repr=False)
    _spent: float = field(default=0.0, init=False, repr=False)
    _productive: float = field(default=0.0, init=False, repr=False)
    _planned_iteration: float = field(default=math.nan, init=False, repr=False)
    _planned_costs: tuple[float, ...] = field(default=(), init=False, repr=False)
    _resumed: bool = field(default=False, init=False, repr=False)
    """A loaded plan not yet checked against this session's iteration time."""

    def __post_init__(self) -> None:
        if not 0 < self.p < 1:
            raise InvalidArgumentError(f"Overhead: p must lie in (0, 1), got {self.p}")
        if self.warmup < 1 or self.window < 1:
            raise InvalidArgumentError("Overhead: warmup and window must be >= 1")
        if not (0 < self.low < 1 and 0 < self.target <= 1 and self.hysteresis >= 0):
            raise InvalidArgumentError("Overhead: need 0 < low < 1, 0 < target <= 1, hysteresis >= 0")

    def should_save(self, ctx: DecisionContext) -> bool:
        self.observe(ctx)
        return self.ready(ctx) and ctx.steps_since_checkpoint >= max(self.interval, 1)

    def state_dict(self) -> dict[str, Any]:
        """The plan, the correction, the whole-run budget and the current verdict window, as JSON.

        The checkpoint-to-checkpoint cycle being measured belongs to the session and is not saved.
        """
        return {
            "params": params_of(self),
            "interval": self.interval,
            "reason": self.reason,
            "correction": self.correction,
            "spent_s": self._spent,
            "productive_s": self._productive,
            "window": list(self._window),
            "why": self._why,
            "planned_iteration_s": finite_or_none(self._planned_iteration),
            "planned_costs_s": [finite_or_none(c) for c in self._planned_costs],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`; the next measurements re-validate the plan (see :meth:`observe`)."""
        check_params(self, state)
        why = state.get("why")
        if why is not None and not isinstance(why, str):
            raise InvalidArgumentError(f"'why' must be a string or null, got {why!r}")
        costs = state.get("planned_costs_s")
        if not isinstance(costs, list) or len(costs) not in (0, 3):
            raise InvalidArgumentError(f"'planned_costs_s' must be a list of three numbers, got {costs!r}")
        interval, reason, window = (
            state_count(state, "interval"),
            state_text(state, "reason"),
            state_numbers(state, "window"),
        )
        correction, spent, productive = (
            state_number(state, k, low=lo)
            for k, lo in (("correction", 1.0), ("spent_s", -math.inf), ("productive_s", 0.0))
        )
        if any(math.isnan(x) for x in (correction, spent, productive)):
            raise InvalidArgumentError("'correction', 'spent_s' and 'productive_s' must be numbers")
        planned_iteration, planned_costs = (
            state_number(state, "planned_iteration_s"),
            tuple(state_number({"cost": c}, "cost") for c in costs),
        )
        self.interval, self.reason, self.correction, self._spent, self._productive = (
            interval,
            reason,
            correction,
            spent,
            productive,
        )
        self._planned_iteration, self._planned_costs = planned_iteration, planned_costs
        self._window, self._why, self._cycles, self._resumed = deque(window), why, _Cycles(), True

    def observe(self, ctx: DecisionContext) -> None:
        """Update the measurements and, when warranted, the plan."""
        t_i = ctx.iteration_time
        if self._cycles.observe(ctx) and self._cycles.closed is not None and measured(t_i):
            steps, seconds = self._cycles.closed
            productive = steps * t_i
            self._spent += seconds - productive
            self._productive += productive
            self._window.append((seconds - productive) / productive)
            if len(self._window) >= self.window:
                self._verdict(sorted(self._window)[len(self._window) // 2])
                self._window.clear()
        if not (measured(t_i) and measured(ctx.stall) and measured(ctx.persist_time)):
            return
        if self._resumed:  # the loaded plan stands, unchanged, until this session's warmup has measured it
            if ctx.session_steps < self.warmup:
                return
            self._revalidate(ctx)
        shifted = measured(self._planned_iteration) and abs(math.log(t_i / self._planned_iteration)) > 0.25
        costs = (ctx.stall, ctx.persist_time, ctx.checkpoint_cost)
        if shifted or self._why is not None or costs != self._planned_costs:
            self._planned_costs = costs
            self._plan(ctx, "iteration time changed" if shifted else None)

    def _revalidate(self, ctx: DecisionContext) -> None:
        """After a restore's warmup: keep the loaded plan if the iteration time is what it was planned
        for; otherwise the run landed elsewhere (another node, another load), and the loaded costs
        and the correction learned from them are suspect too: plan nothing until a checkpoint of this
        session has measured the costs afresh, and plan uncorrected (the budget spent is kept)."""
        self._resumed = False
        before, now = self._planned_iteration, ctx.iteration_time
        if not measured(before) or abs(math.log(now / before)) <= 0.25:
            return
        self.reason = f"re-profiling after the restore: iteration {now * 1e3:.2f} ms, planned for {before * 1e3:.2f} ms"
        log.info("Overhead: interval %d → 0 steps (%s)", self.interval, self.reason)
        self.interval, self._planned_iteration, self.correction, self._why = 0, math.nan, 1.0, None
        self._window.clear()
        self._planned_costs = (ctx.stall, ctx.persist_time, ctx.checkpoint_cost)  # replan once they change

    def ready(self, ctx: DecisionContext) -> bool:
        """Whether the guards allow a checkpoint now: this session profiled, nothing in flight, within budget."""
        if ctx.persist_in_flight or ctx.session_steps < self.warmup or not measured(ctx.iteration_time):
            return False
        if self.interval == 0:  # a checkpoint measures what checkpoints cost; then the plan waits for it
            return ctx.steps_since_checkpoint >= self.warmup
        since = ctx.steps_since_checkpoint * ctx.iteration_time
        return self._spent + self.cost(ctx) <= self.p * (self._productive + since)

    def cost(self, ctx: DecisionContext) -> float:
        """Seconds one checkpoint costs the training loop: its stall plus the persist's slowdown.

        The measured cost when there is one; otherwise estimated from the persist time and the
        average slowdown of persisting iterations (which underestimates a slowdown that is
        concentrated in the first iteration the persist overlaps).
        """
        if measured(ctx.checkpoint_cost):
            return ctx.checkpoint_cost
        slowdown = interference(ctx.iteration_time, ctx.iteration_time_while_persisting)
        return ctx.stall + ctx.persist_time * slowdown / (1.0 + slowdown)

    def _verdict(self, measured: float) -> None:
        if measured > self.p:
            self.correction = min(self.correction * measured / (self.target * self.p), 64.0)
            self._why = f"measured overhead {measured:.2%} > p={self.p:.2%}"
        elif measured < self.low * self.p and self.correction > 1.0:
            self.correction = max(1.0, self.correction * max(measured / (self.target * self.p), 0.5))
            self._why = f"measured overhead {measured:.2%} < {self.low:g}·p"

    def _plan(self, ctx: DecisionContext, why: str | None) -> None:
        t_i = ctx.iteration_time
        k = overhead_steps(t_i, self.cost(ctx) * self.correction, ctx.persist_time, self.target * self.p)
        why = why or self._why
        self._why = None
        grow = k > self.interval
        shrink = k * (1.0 + self.hysteresis) < self.interval or (why == "iteration time changed" and k != self.interval)
        if why == "iteration time changed":
            self._planned_iteration = t_i
        if not (grow or shrink):
            return
        first = self.interval == 0
        self.reason = (
            f"{'profiled' if first else why or 'costs changed'}: stall {ctx.stall * 1e3:.1f} ms, "
            f"persist {ctx.persist_time * 1e3:.1f} ms, iteration {t_i * 1e3:.2f} ms, "
            f"slowdown while persisting {interference(t_i, ctx.iteration_time_while_persisting):.0%}, "
            f"cost per checkpoint {self.cost(ctx) * 1e3:.1f} ms, "
            f"correction ×{self.correction:.2f} → every {k} steps for ≤ {self.p:.1%} overhead"
        )
        log.info("Overhead: interval %d → %d steps (%s)", self.interval, k, self.reason)
        self.interval, self._planned_iteration = k, t_i
