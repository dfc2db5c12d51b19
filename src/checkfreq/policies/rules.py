"""When to checkpoint: small, pure decision objects.

A policy answers :meth:`Policy.should_save` from a read-only :class:`DecisionContext`; it
never touches torch or storage, so it can be unit-tested with plain numbers. Adaptive policies
expose their current decision as ``interval`` (steps between checkpoints) and ``reason`` (why
that interval now), and log every change on the ``checkfreq.policies`` logger.

Sessions: a run that is restored starts a new session (a new process, a fresh profiler). A policy
that needs measurements waits ``warmup`` steps of *this* session and a measured iteration time
before any checkpoint: a missing measurement means "wait and measure", never "checkpoint now".
What a policy learned travels in every checkpoint through :meth:`StatefulPolicy.state_dict` (plain
JSON) and seeds the resumed session's policy, which re-validates it against the fresh
measurements (docs/policies.md, "Sessions and restarts").
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from checkfreq.errors import ArgumentTypeError, InvalidArgumentError
from checkfreq.policies.intervals import convergence_interval, overhead_steps, place_optimal, two_phase_interval
from checkfreq.policies.losscurve import LossCurve, fit_power_law
from checkfreq.policies.profiler import interference

log = logging.getLogger("checkfreq.policies")


@dataclass(frozen=True)
class DecisionContext:
    """What a policy may look at, built by the Checkpointer at every ``step()``.

    Times are seconds; NaN means "not measured yet".
    """

    step: int
    """Optimizer steps taken so far (including this one), over every session of the run."""
    session_steps: int
    """Steps taken in this session: since the Checkpointer was created or restored (including this one)."""
    steps_since_checkpoint: int
    """Steps since the last checkpoint, or since the restore if this session has taken none."""
    elapsed: float
    """Seconds since the Checkpointer was created (or restored)."""
    seconds_since_checkpoint: float
    iteration_time: float
    iteration_time_while_persisting: float
    stall: float
    persist_time: float
    bytes_per_checkpoint: int
    persist_in_flight: bool
    epoch: int | None = None
    epoch_changed: bool = False
    loss: float | None = None
    checkpoint_cost: float = math.nan
    """What a checkpoint cost the loop, measured: its stall plus the extra time of the iterations its persist overlapped."""


@runtime_checkable
class Policy(Protocol):
    """Decides, at each step, whether to take a checkpoint now."""

    def should_save(self, ctx: DecisionContext) -> bool: ...


@runtime_checkable
class StatefulPolicy(Policy, Protocol):
    """A policy whose learned state a checkpoint carries into the next session.

    ``state_dict()`` returns plain JSON (numbers, strings, lists, dicts, ``None``);
    ``load_state_dict()`` raises ``ValueError``, before changing anything, when the state is
    malformed or was saved by a policy configured differently.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def _measured(x: float) -> bool:
    return x > 0 and math.isfinite(x)


def _params(policy: Any) -> dict[str, Any]:
    """The constructor arguments of a dataclass policy: the configuration its state belongs to."""
    return {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if f.init}


def _check_params(policy: Any, state: Mapping[str, Any]) -> None:
    saved, current = state.get("params"), _params(policy)
    if saved != current:
        raise InvalidArgumentError(f"state saved by {type(policy).__name__}({saved}), this run uses {type(policy).__name__}({current})")


def _number(state: Mapping[str, Any], key: str, *, low: float = 0.0) -> float:
    """A saved finite number >= ``low``; ``None`` (not measured) reads as NaN."""
    value = state.get(key)
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= low):
        raise InvalidArgumentError(f"{key!r} must be a finite number >= {low:g} or null, got {value!r}")
    return float(value)


def _count(state: Mapping[str, Any], key: str) -> int:
    value = state.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"{key!r} must be a non-negative integer, got {value!r}")
    return value


def _text(state: Mapping[str, Any], key: str) -> str:
    value = state.get(key)
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{key!r} must be a string, got {value!r}")
    return value


def _numbers(state: Mapping[str, Any], key: str) -> list[float]:
    values = state.get(key)
    if not isinstance(values, list):
        raise InvalidArgumentError(f"{key!r} must be a list of numbers, got {type(values).__name__}")
    return [_number({key: v}, key, low=-math.inf) for v in values]


def _finite_or_none(x: float) -> float | None:
    """``x`` as a float, or None where it is inf or nan (a policy's state is strict JSON)."""
    return float(x) if math.isfinite(x) else None


@dataclass
class Every:
    """Checkpoint every ``n`` steps, or every ``seconds`` of wall time (give exactly one).

    ``seconds`` count from the last checkpoint or the restore; a checkpoint due while the previous
    one is still being written waits for it to be durable (it would only block the loop).
    """

    n: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        if (self.n is None) == (self.seconds is None):
            raise InvalidArgumentError("Every: give exactly one of n= or seconds=")
        if self.n is not None and self.n < 1:
            raise InvalidArgumentError(f"Every: n must be >= 1, got {self.n}")
        if self.seconds is not None and not (self.seconds > 0 and math.isfinite(self.seconds)):
            raise InvalidArgumentError(f"Every: seconds must be a positive number, got {self.seconds}")

    def should_save(self, ctx: DecisionContext) -> bool:
        if self.n is not None:
            return ctx.steps_since_checkpoint >= self.n
        return not ctx.persist_in_flight and ctx.seconds_since_checkpoint >= self.seconds  # type: ignore[operator]

    def state_dict(self) -> dict[str, Any]:
        """A fixed cadence learns nothing: only its configuration."""
        return {"params": _params(self)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_params(self, state)


@dataclass
class EveryEpoch:
    """Checkpoint at the first step of every new epoch (the epoch of a registered loader)."""

    def should_save(self, ctx: DecisionContext) -> bool:
        return ctx.epoch_changed


@dataclass
class _Cycles:
    """Detects checkpoints from the context and measures each checkpoint-to-checkpoint cycle."""

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
        step, time = ctx.step - ctx.steps_since_checkpoint, ctx.elapsed - ctx.seconds_since_checkpoint
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
            "params": _params(self),
            "interval": self.interval,
            "reason": self.reason,
            "correction": self.correction,
            "spent_s": self._spent,
            "productive_s": self._productive,
            "window": list(self._window),
            "why": self._why,
            "planned_iteration_s": _finite_or_none(self._planned_iteration),
            "planned_costs_s": [_finite_or_none(c) for c in self._planned_costs],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`; the next measurements re-validate the plan (see :meth:`observe`)."""
        _check_params(self, state)
        why = state.get("why")
        if why is not None and not isinstance(why, str):
            raise InvalidArgumentError(f"'why' must be a string or null, got {why!r}")
        costs = state.get("planned_costs_s")
        if not isinstance(costs, list) or len(costs) not in (0, 3):
            raise InvalidArgumentError(f"'planned_costs_s' must be a list of three numbers, got {costs!r}")
        interval, reason, window = _count(state, "interval"), _text(state, "reason"), _numbers(state, "window")
        correction, spent, productive = (_number(state, k, low=lo) for k, lo in (("correction", 1.0), ("spent_s", -math.inf), ("productive_s", 0.0)))
        if any(math.isnan(x) for x in (correction, spent, productive)):
            raise InvalidArgumentError("'correction', 'spent_s' and 'productive_s' must be numbers")
        planned_iteration, planned_costs = _number(state, "planned_iteration_s"), tuple(_number({"cost": c}, "cost") for c in costs)
        self.interval, self.reason, self.correction, self._spent, self._productive = interval, reason, correction, spent, productive
        self._planned_iteration, self._planned_costs = planned_iteration, planned_costs
        self._window, self._why, self._cycles, self._resumed = deque(window), why, _Cycles(), True

    def observe(self, ctx: DecisionContext) -> None:
        """Update the measurements and, when warranted, the plan."""
        t_i = ctx.iteration_time
        if self._cycles.observe(ctx) and self._cycles.closed is not None and _measured(t_i):
            steps, seconds = self._cycles.closed
            productive = steps * t_i
            self._spent += seconds - productive
            self._productive += productive
            self._window.append((seconds - productive) / productive)
            if len(self._window) >= self.window:
                self._verdict(sorted(self._window)[len(self._window) // 2])
                self._window.clear()
        if not (_measured(t_i) and _measured(ctx.stall) and _measured(ctx.persist_time)):
            return
        if self._resumed:  # the loaded plan stands, unchanged, until this session's warmup has measured it
            if ctx.session_steps < self.warmup:
                return
            self._revalidate(ctx)
        shifted = _measured(self._planned_iteration) and abs(math.log(t_i / self._planned_iteration)) > 0.25
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
        if not _measured(before) or abs(math.log(now / before)) <= 0.25:
            return
        self.reason = f"re-profiling after the restore: iteration {now * 1e3:.2f} ms, planned for {before * 1e3:.2f} ms"
        log.info("Overhead: interval %d → 0 steps (%s)", self.interval, self.reason)
        self.interval, self._planned_iteration, self.correction, self._why = 0, math.nan, 1.0, None
        self._window.clear()
        self._planned_costs = (ctx.stall, ctx.persist_time, ctx.checkpoint_cost)  # replan once they change

    def ready(self, ctx: DecisionContext) -> bool:
        """Whether the guards allow a checkpoint now: this session profiled, nothing in flight, within budget."""
        if ctx.persist_in_flight or ctx.session_steps < self.warmup or not _measured(ctx.iteration_time):
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
        if _measured(ctx.checkpoint_cost):
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
        return not ctx.persist_in_flight and ctx.session_steps >= self.warmup and _measured(ctx.iteration_time)

    def state_dict(self) -> dict[str, Any]:
        return {"params": _params(self), "interval": self.interval, "reason": self.reason}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_params(self, state)
        self.interval, self.reason = _count(state, "interval"), _text(state, "reason")

    def observe(self, ctx: DecisionContext) -> None:
        if not (_measured(ctx.iteration_time) and _measured(ctx.stall)):
            return
        persist = ctx.persist_time if _measured(ctx.persist_time) else 0.0
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


@dataclass
class Auto:
    """The default: never more overhead than ``p``; with an MTBF, no more often than failures justify.

    The interval is the longer of :class:`Overhead`'s (the shortest the bound allows) and, when
    ``mtbf`` is given, :class:`YoungDaly`'s failure-optimal one. Without an MTBF it checkpoints
    as often as ``p`` allows.
    """

    p: float = 0.035
    mtbf: float | None = None
    overhead: Overhead = field(init=False)
    failures: YoungDaly | None = field(init=False)

    def __post_init__(self) -> None:
        self.overhead = Overhead(self.p)
        self.failures = YoungDaly(self.mtbf) if self.mtbf is not None else None

    @property
    def interval(self) -> int:
        return max(self.overhead.interval, self.failures.interval if self.failures else 0)

    @property
    def reason(self) -> str:
        if self.failures is not None and self.failures.interval > self.overhead.interval:
            return f"failure-optimal: {self.failures.reason}"
        return f"overhead bound: {self.overhead.reason}"

    def should_save(self, ctx: DecisionContext) -> bool:
        self.overhead.observe(ctx)
        if self.failures is not None:
            self.failures.observe(ctx)
        return self.overhead.ready(ctx) and ctx.steps_since_checkpoint >= max(self.interval, 1)

    def state_dict(self) -> dict[str, Any]:
        failures = None if self.failures is None else self.failures.state_dict()
        return {"params": _params(self), "overhead": self.overhead.state_dict(), "failures": failures}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_params(self, state)
        overhead, failures = state.get("overhead"), state.get("failures")
        if not isinstance(overhead, Mapping) or (self.failures is not None) != isinstance(failures, Mapping):
            raise InvalidArgumentError("Auto's state needs its 'overhead' state (and 'failures' with an mtbf)")
        fresh = Overhead(self.p)
        fresh.load_state_dict(overhead)  # validated in full before anything here changes
        if self.failures is not None:
            self.failures.load_state_dict(failures)  # type: ignore[arg-type]
        self.overhead = fresh


@dataclass
class ConvergenceAware:
    """Denser checkpoints early, sparser late: lost progress valued by what it bought (docs/algorithms.md §3).

    Fits ``L = a + b·(step + w0)^(−c)`` to the losses passed to ``step(loss=…)`` every
    ``refit_every`` steps (every tenth of the steps so far, later on) and adopts a new fit only when its value weight ``ω`` moved by more
    than ``replan_tolerance``. The interval at the current step is the closed form
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
                raise InvalidArgumentError(f"ConvergenceAware: {name} must be a positive number of seconds, got {value}")
        if not (self.beta >= 0 and math.isfinite(self.beta)):
            raise InvalidArgumentError(f"ConvergenceAware: beta must be >= 0, got {self.beta}")
        if self.refit_every < 1 or self.max_points < 16 or not self.replan_tolerance > 0:
            raise InvalidArgumentError("ConvergenceAware: need refit_every >= 1, max_points >= 16, replan_tolerance > 0")
        self._fallback = YoungDaly(self.mtbf)

    def should_save(self, ctx: DecisionContext) -> bool:
        self._fallback.observe(ctx)
        if ctx.loss is not None and math.isfinite(ctx.loss):
            self._record(ctx.step, ctx.loss)
        if ctx.step >= self._next_fit and _measured(ctx.iteration_time) and _measured(ctx.stall):
            self._next_fit = ctx.step + max(self.refit_every, ctx.step // 10)  # refits get rarer as data accrue
            self._refit(ctx)
        if self.curve is None:
            self.interval, self.reason = self._fallback.interval, f"no loss fit yet: {self._fallback.reason}"
            return self._fallback.should_save(ctx)
        if not (self._fallback.ready(ctx) and _measured(ctx.stall)):  # this session profiles first
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
            "params": _params(self),
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
        _check_params(self, state)
        steps, losses, curve, plan = _numbers(state, "steps"), _numbers(state, "losses"), state.get("curve"), state.get("plan")
        if len(steps) != len(losses) or len(steps) > self.max_points:
            raise InvalidArgumentError(f"'steps' and 'losses' must be lists of equal length <= {self.max_points}")
        if curve is not None and not (isinstance(curve, Mapping) and set(curve) == {"a", "b", "w0", "c"}):
            raise InvalidArgumentError(f"'curve' must be null or {{a, b, w0, c}}, got {curve!r}")
        coefficients = [] if curve is None else [_number(curve, k, low=-math.inf) for k in ("a", "b", "w0", "c")]
        if any(math.isnan(x) for x in coefficients):
            raise InvalidArgumentError(f"'curve' coefficients must be numbers, got {curve!r}")
        fit = LossCurve(*coefficients) if coefficients else None
        placed = None if plan is None else np.asarray(_numbers(state, "plan"))
        fallback, stride = YoungDaly(self.mtbf), _count(state, "stride")
        if not isinstance(state.get("fallback"), Mapping) or stride < 1:
            raise InvalidArgumentError("ConvergenceAware's state needs 'fallback' and a 'stride' >= 1")
        fallback.load_state_dict(state["fallback"])
        self.interval, self.reason, next_fit = _count(state, "interval"), _text(state, "reason"), _count(state, "next_fit")
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
        persist = ctx.persist_time if _measured(ctx.persist_time) else 0.0
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
            f"loss fit a={fit.a:.3g} b={fit.b:.3g} w0={fit.w0:.3g} c={fit.c:.3g}: ω={fit.weight(ctx.step, horizon):.3g} "
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


def resolve(policy: Policy | str | int) -> Policy:
    """Turn the Checkpointer's ``policy=`` argument into a policy object."""
    if isinstance(policy, int) and not isinstance(policy, bool):
        return Every(policy)
    if policy == "auto":
        return Auto()
    if isinstance(policy, Policy):
        return policy
    raise ArgumentTypeError(f"policy must be a Policy, an int (every n steps) or 'auto', got {policy!r}")
