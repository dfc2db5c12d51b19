"""Policies across a restart, with plain numbers: the real Profiler fed with simulated times.

A :class:`Session` is one process of a run, stepping a simulated clock and building each
:class:`DecisionContext` the way the Checkpointer does (its iteration samples include the
stall and count as persisting when a persist overlapped any part of them). A checkpoint saves
what the Checkpointer saves (the profile and the policy's state, through JSON); a restart is a
new Session from the newest durable checkpoint, with a fresh profiler and policy seeded from it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from checkfreq.policies import Auto, ConvergenceAware, DecisionContext, Every, Overhead, Policy, YoungDaly
from checkfreq.policies.losscurve import LossCurve
from checkfreq.policies.profiler import Profiler

HOUR = 3600.0
WORKED = LossCurve(a=0.2, b=120.0, w0=360.0, c=0.5)  # docs/algorithms.md §3, one step = one second


@dataclass
class Session:
    policy: Policy
    iteration: float
    stall: float
    persist: float
    slowdown: float = 0.0
    """How much slower an iteration runs while a persist overlaps it."""
    start_step: int = 0
    loss: LossCurve | None = None
    profiler: Profiler = field(default_factory=Profiler)
    step: int = field(init=False)
    now: float = 0.0
    last_step_time: float | None = None
    last_checkpoint_step: int = field(init=False)
    last_checkpoint_time: float = 0.0
    durable_at: float = -math.inf
    recorded: float = -math.inf
    checkpoints: list[int] = field(default_factory=list)
    clean_before: list[bool] = field(default_factory=list)
    """For each checkpoint: whether an iteration with no persist ran in this session before it (since the previous
    one)."""
    saved: list[tuple[int, float, dict[str, Any]]] = field(default_factory=list)
    """(step, durable at, state) of each checkpoint."""
    _clean_since_checkpoint: bool = False

    def __post_init__(self) -> None:
        self.step = self.last_checkpoint_step = self.start_step

    @classmethod
    def resumed(cls, make: Callable[[], Policy], killed: Session, **changes: Any) -> Session:
        """A new process that restores ``killed``'s newest durable checkpoint (``changes``: another node)."""
        step, _, state = max((s for s in killed.saved if s[1] <= killed.now), key=lambda s: s[0])
        policy = make()
        policy.load_state_dict(state["policy"])  # type: ignore[attr-defined]
        profiler = Profiler()
        profiler.load_state_dict(state["profile"])
        timing = {k: getattr(killed, k) for k in ("iteration", "stall", "persist", "slowdown", "loss")}
        return cls(policy, start_step=step, profiler=profiler, **{**timing, **changes})

    def run(self, steps: int) -> Session:
        for _ in range(steps):
            self._step()
        return self

    def _step(self) -> None:
        begin = self.now
        persisting = self.durable_at > begin
        self.now += self.iteration * (1 + self.slowdown if persisting else 1)
        self.step += 1
        if self.last_step_time is not None:
            self.profiler.record_iteration(self.now - self.last_step_time, persisting=persisting)
            self._clean_since_checkpoint |= not persisting
        self.last_step_time = self.now
        if self.recorded < self.durable_at <= self.now:
            self.profiler.record_persist(self.persist, 10**6)
            self.recorded = self.durable_at
        loss = float(self.loss.value(self.step)) if self.loss else None
        ctx = DecisionContext(
            step=self.step,
            session_steps=self.step - self.start_step,
            steps_since_checkpoint=self.step - self.last_checkpoint_step,
            elapsed=self.now,
            seconds_since_checkpoint=self.now - self.last_checkpoint_time,
            iteration_time=self.profiler.iteration.value,
            iteration_time_while_persisting=self.profiler.iteration_while_persisting.value,
            stall=self.profiler.stall.value,
            persist_time=self.profiler.persist.value,
            checkpoint_cost=self.profiler.checkpoint_cost.value,
            bytes_per_checkpoint=10**6,
            persist_in_flight=self.durable_at > self.now,
            loss=loss,
        )
        if self.policy.should_save(ctx):
            self._checkpoint()

    def _checkpoint(self) -> None:
        self.now = max(self.now, self.durable_at)  # one checkpoint in flight: wait for the previous one
        state = {"policy": self.policy.state_dict(), "profile": self.profiler.state_dict()}  # type: ignore[attr-defined]
        self.profiler.begin_checkpoint()
        self.last_checkpoint_step, self.last_checkpoint_time = self.step, self.now
        self.now += self.stall
        self.profiler.record_stall(self.stall)
        self.durable_at = self.last_checkpoint_time + self.persist
        self.saved.append((self.step, self.durable_at, json.loads(json.dumps(state, allow_nan=False))))
        self.checkpoints.append(self.step)
        self.clean_before.append(self._clean_since_checkpoint)
        self._clean_since_checkpoint = False

    def gaps(self, after: int = 0) -> list[int]:
        steps = [s for s in self.checkpoints if s > after]
        return [b - a for a, b in zip(steps, steps[1:], strict=False)]


# ------------------------------------------------ a context after a restore: wait and measure


def _restored_context(**changes: Any) -> DecisionContext:
    nan = math.nan
    fields = dict(
        step=1_000_000,
        session_steps=1,
        steps_since_checkpoint=1,
        elapsed=0.01,
        seconds_since_checkpoint=0.01,
        iteration_time=nan,
        iteration_time_while_persisting=nan,
        stall=nan,
        persist_time=nan,
        bytes_per_checkpoint=0,
        persist_in_flight=False,
        loss=1.0,
    )
    return DecisionContext(**{**fields, **changes})


POLICIES: dict[str, Callable[[], Policy]] = {
    "Overhead": lambda: Overhead(p=0.05),
    "Auto": Auto,
    "Auto(mtbf)": lambda: Auto(mtbf=0.5 * HOUR),
    "YoungDaly": lambda: YoungDaly(mtbf=0.5 * HOUR),
    "ConvergenceAware": lambda: ConvergenceAware(mtbf=0.5 * HOUR, horizon=HOUR),
    "Every(seconds)": lambda: Every(seconds=0.05),
}


@pytest.mark.parametrize("name", POLICIES)
def test_a_restored_context_without_measurements_never_checkpoints_back_to_back(name: str) -> None:
    """Large global step, nothing measured in this session: the policy waits, then measures."""
    policy = POLICIES[name]()
    assert not policy.should_save(_restored_context())
    for session_step in range(2, 10):  # still nothing measured: never "checkpoint now"
        assert not policy.should_save(
            _restored_context(session_steps=session_step, steps_since_checkpoint=session_step)
        )
    # the session that follows, with a persist of 3.5 iterations that slows them by half
    session = Session(POLICIES[name](), iteration=0.01, stall=0.002, persist=0.035, slowdown=0.5, start_step=1_000_000)
    session.run(400)
    assert session.checkpoints, "the policy never checkpointed"
    assert all(session.clean_before), f"a checkpoint with no clean iteration before it: {session.checkpoints[:12]}"
    assert min(session.gaps()) >= 4, session.checkpoints[:12]  # never before the previous persist is over
    if name != "Every(seconds)":
        assert session.checkpoints[0] - session.start_step >= 10  # the session's warmup


def test_every_seconds_waits_for_the_checkpoint_in_flight() -> None:
    policy = Every(seconds=0.01)
    assert not policy.should_save(_restored_context(seconds_since_checkpoint=1.0, persist_in_flight=True))
    assert policy.should_save(_restored_context(seconds_since_checkpoint=1.0))


def test_a_fit_without_this_sessions_measurements_waits() -> None:
    """A restored loss fit cannot place a checkpoint before the session has measured its iterations."""
    donor = Session(
        ConvergenceAware(mtbf=4 * HOUR, horizon=24 * HOUR), iteration=1.0, stall=30.0, persist=60.0, loss=WORKED
    )
    donor.run(3000)
    policy = ConvergenceAware(mtbf=4 * HOUR, horizon=24 * HOUR)
    policy.load_state_dict(donor.saved[-1][2]["policy"])
    assert policy.curve is not None
    assert not policy.should_save(_restored_context(step=donor.saved[-1][0] + 5000, steps_since_checkpoint=5000))


# ------------------------------------------------ killed and resumed = continuing, once re-validated

# policy, its hysteresis, timings (iteration, stall, persist, slowdown), steps before the kill, steps after
RESUMES: dict[str, tuple[Callable[[], Policy], float, tuple[float, float, float, float], int, int]] = {
    "Overhead": (lambda: Overhead(p=0.05), 0.3, (0.01, 0.004, 0.1, 0.3), 1500, 1500),
    "Auto": (Auto, 0.3, (0.01, 0.004, 0.1, 0.3), 1500, 1500),
    "Auto(mtbf)": (lambda: Auto(mtbf=20.0), 0.3, (0.01, 0.004, 0.1, 0.3), 1500, 1500),
    "YoungDaly": (lambda: YoungDaly(mtbf=4 * HOUR), 0.1, (1.0, 30.0, 60.0, 0.0), 3000, 3000),
    "ConvergenceAware": (
        lambda: ConvergenceAware(mtbf=4 * HOUR, horizon=24 * HOUR),
        0.1,
        (1.0, 30.0, 60.0, 0.0),
        4000,
        4000,
    ),
    "Every(seconds)": (lambda: Every(seconds=0.5), 0.0, (0.01, 0.004, 0.1, 0.3), 1000, 1000),
}


def _interval(session: Session) -> float:
    if isinstance(session.policy, Every):  # a time cadence: the steps between its last checkpoints
        return session.gaps()[-1]
    return session.policy.interval  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", RESUMES)
@pytest.mark.parametrize("slower", [1.0, 1.6], ids=["same node", "slower node"])
def test_killed_and_resumed_decides_as_the_continuing_run(name: str, slower: float) -> None:
    make, hysteresis, (iteration, stall, persist, slowdown), before, after = RESUMES[name]
    loss = WORKED if name == "ConvergenceAware" else None
    run = Session(make(), iteration, stall, persist, slowdown, loss=loss).run(before)
    killed = Session.resumed(make, run, iteration=iteration * slower)
    lost = run.step - killed.step
    run.iteration *= slower  # the run that was not killed meets the same change of node
    run.run(after)
    killed.run(after + lost)
    assert killed.step == run.step
    assert all(killed.clean_before) and killed.checkpoints[0] - killed.start_step >= 10
    mine, continuing = _interval(killed), _interval(run)
    assert abs(mine - continuing) <= max(hysteresis * continuing, 1), (mine, continuing, killed.policy)
    continued = [s for s in run.checkpoints if s > killed.start_step]
    assert len(killed.checkpoints) <= (1 + hysteresis) * len(continued) + 1, (killed.checkpoints, continued)


@pytest.mark.parametrize("name", ["Overhead", "Auto(mtbf)", "YoungDaly", "ConvergenceAware"])
def test_a_malformed_or_foreign_state_is_refused_and_changes_nothing(name: str) -> None:
    make, _, (iteration, stall, persist, slowdown), before, _ = RESUMES[name]
    run = Session(make(), iteration, stall, persist, slowdown, loss=WORKED).run(before)
    state = run.saved[-1][2]["policy"]
    inner = "overhead" if name.startswith("Auto") else None
    broken = {**state, inner: {**state[inner], "interval": -1}} if inner else {**state, "interval": "ten"}
    foreign = {
        **state,
        "params": {**state["params"], "mtbf": 1.0} if "mtbf" in state["params"] else {**state["params"], "p": 0.5},
    }
    policy = make()
    pristine = policy.state_dict()  # type: ignore[attr-defined]
    for bad in (broken, foreign, {**state, "params": None}):
        with pytest.raises(ValueError):
            policy.load_state_dict(bad)  # type: ignore[attr-defined]
        assert policy.state_dict() == pristine  # type: ignore[attr-defined]
    policy.load_state_dict(state)  # type: ignore[attr-defined]
    assert policy.state_dict() == state  # type: ignore[attr-defined]
