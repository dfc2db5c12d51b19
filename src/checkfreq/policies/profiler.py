"""Online measurements of a run: iteration time, stall, persist time and bandwidth.

The Checkpointer feeds it; policies read a :class:`~checkfreq.policies.DecisionContext` built from
it. Every method is O(1) and allocation-free, so steps without a checkpoint cost nanoseconds.
A profiler lives for one session (a process, from its start or restore); :meth:`Profiler.state_dict`
goes into every checkpoint and seeds the next session's profiler, whose fresh samples re-validate
the seeded estimates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Smoothed:
    """An exponentially smoothed estimate, robust to outliers, that re-profiles on a phase change.

    A sample is clipped to ``[value / clip, value · clip]`` before it enters the average, so a
    single spike moves the estimate little. When ``shift_after`` samples in a row all lie outside
    ``[value / (1 + band), value · (1 + band)]`` on the same side, the regime has changed (a new
    phase, a co-located job): the estimate restarts from the median of those samples.
    """

    alpha: float = 0.1
    clip: float = 1.5
    band: float = 0.3
    shift_after: int = 8
    jump_up: bool = False
    """Adopt at once any sample above the band (a conservative upper estimate, for costs)."""
    value: float = math.nan
    count: int = 0
    shifts: int = 0
    """How many phase changes were detected."""
    _run_side: int = field(default=0, repr=False)
    _run: list[float] = field(default_factory=list, repr=False)

    def add(self, x: float) -> bool:
        """Add a sample; returns True when it completed a detected phase change."""
        if not (x >= 0 and math.isfinite(x)):
            return False
        self.count += 1
        if self.count == 1 or not self.value > 0:
            self.value = x
            return False
        side = 1 if x > self.value * (1 + self.band) else -1 if x < self.value / (1 + self.band) else 0
        if side == 1 and self.jump_up:
            self.value, self._run_side = x, 0
            self._run.clear()
            self.shifts += 1
            return True
        if side == 0 or side != self._run_side:
            self._run.clear()
        self._run_side = side
        if side != 0:
            self._run.append(x)
            if len(self._run) >= self.shift_after:
                self.value = sorted(self._run)[len(self._run) // 2]
                self.shifts += 1
                self._run.clear()
                self._run_side = 0
                return True
        clipped = min(max(x, self.value / self.clip), self.value * self.clip)
        self.value += self.alpha * (clipped - self.value)
        return False

    def seed(self, value: float) -> None:
        """Start from ``value``, a previous session's estimate, counted as one sample.

        Fresh samples then move it as they would have moved the previous session's estimate: a
        few nearby ones smooth it, ``shift_after`` in a row beyond the band (another node, another
        load) replace it by their median, and a costlier sample of a ``jump_up`` estimate at once.
        """
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"a seeded estimate must be a non-negative number, got {value!r}")
        self.value, self.count, self._run_side = value, 1, 0
        self._run.clear()


AWAY_FACTOR = 2.0
"""A step with no persist that takes more than this many iteration times held other work too."""


@dataclass
class Profiler:
    """Measurements the policies decide from.

    Iteration samples are wall time between consecutive ``step()`` calls; the stall of a
    checkpoint and that of a memory snapshot (each recorded just before the sample that contains
    it) are subtracted, so the iteration estimates measure training only. Checkpoint stalls are
    counted once, in :attr:`stall`; memory snapshot stalls are the memory cadence's to budget.
    """

    iteration: Smoothed = field(default_factory=Smoothed)
    """Iteration time with no persist running (the baseline ``t_i``)."""
    iteration_while_persisting: Smoothed = field(default_factory=Smoothed)
    """Iteration time while a background persist competes for CPU, memory bandwidth and disk."""
    stall: Smoothed = field(default_factory=lambda: _cost_estimate())
    """Seconds the loop is blocked per checkpoint; rises at once, falls after two lower samples."""
    persist: Smoothed = field(default_factory=lambda: _cost_estimate())
    """Seconds from the start of a checkpoint until it is durable."""
    bandwidth: Smoothed = field(default_factory=lambda: Smoothed(alpha=0.3, clip=4.0, band=0.5, shift_after=2))
    """Bytes per second of the persist, end to end."""
    checkpoint_cost: Smoothed = field(default_factory=lambda: _cost_estimate())
    """Seconds one checkpoint cost the training loop, measured whole: its stall plus the time the
    iterations its persist overlapped took beyond :attr:`iteration`."""
    bytes_per_checkpoint: int = 0
    away: float = 0.0
    """Seconds the loop spent between steps on neither training nor checkpointing (an evaluation,
    an epoch's end): a step that no persist overlapped and that took more than
    :data:`AWAY_FACTOR` times :attr:`iteration` adds what it took beyond :attr:`iteration`; a step
    that a persist overlapped, what it took beyond :attr:`iteration` plus :attr:`persist` (a
    background write cannot slow a step by more than it lasts)."""
    _stall_to_discount: float = 0.0
    _open_cost: float | None = None  # the cost of the checkpoint whose aftermath is being measured

    def begin_checkpoint(self) -> None:
        """A checkpoint starts: measure its cost until an iteration runs with no persist."""
        self._close_cost()
        self._open_cost = 0.0

    def record_iteration(self, seconds: float, persisting: bool) -> float:
        """One step's wall time; ``persisting``: a background write overlapped it. Returns the
        seconds of it spent on other work (added to :attr:`away`)."""
        seconds, self._stall_to_discount = max(seconds - self._stall_to_discount, 0.0), 0.0
        away_before = self.away
        if not persisting and self.iteration.value > 0 and seconds > AWAY_FACTOR * self.iteration.value:
            self.away += seconds - self.iteration.value
        if self._open_cost is not None and not persisting:
            self._close_cost()
        elif self._open_cost is not None:
            if self.iteration.value > 0:
                extra = seconds - self.iteration.value
                if self.persist.value > 0 and extra > self.persist.value:  # a write slows a step by its length at most
                    self.away += extra - self.persist.value
                    extra = self.persist.value
                self._open_cost += extra
            else:  # no clean baseline yet: this checkpoint's cost cannot be told apart
                self._open_cost = None
        (self.iteration_while_persisting if persisting else self.iteration).add(seconds)
        return self.away - away_before

    def record_between(self, seconds: float) -> float:
        """The loop's own work between a ``step()`` and the consistent point where a checkpoint is captured
        (loading the next batch, a scheduler, an evaluation). Returns what of it was other work (added to
        :attr:`away`): all of it when it took longer than an iteration would, else nothing (it is then
        part of the next iteration's time)."""
        if self.iteration.value > 0 and seconds > AWAY_FACTOR * self.iteration.value:
            self.away += seconds
            return seconds
        return 0.0

    def record_stall(self, seconds: float) -> None:
        """Time the training thread was blocked by one checkpoint (snapshot plus fence wait)."""
        self.stall.add(seconds)
        self._stall_to_discount += seconds
        if self._open_cost is not None:
            self._open_cost += seconds

    def record_device_wait(self, seconds: float) -> None:
        """A CUDA training stream waited ``seconds`` on a checkpoint's copies, measured once the GPU
        passed the wait (after the stall was recorded): the stall estimate rises by it at once. The
        iterations it lengthened are measured already, so they are not corrected."""
        self.stall.value = seconds + (self.stall.value if math.isfinite(self.stall.value) else 0.0)

    def record_memory_stall(self, seconds: float) -> None:
        """Time the training thread was blocked by a memory-only snapshot (its copy, its fence
        wait, creating the region): not training, so not iteration time, but no checkpoint's
        stall or cost either."""
        self._stall_to_discount += seconds

    def _close_cost(self) -> None:
        if self._open_cost is not None:
            self.checkpoint_cost.add(max(self._open_cost, 0.0))
        self._open_cost = None

    def record_persist(self, seconds: float, nbytes: int) -> None:
        """Duration of one checkpoint from its start to its durable commit, and its size."""
        self.persist.add(seconds)
        self.bytes_per_checkpoint = nbytes
        if seconds > 0 and nbytes > 0:
            self.bandwidth.add(nbytes / seconds)

    def state_dict(self) -> dict[str, Any]:
        """The estimates as JSON-able numbers (``None``: not measured), for the checkpoint."""
        estimates = {name: _known(getattr(self, name).value) for name in _SEEDED}
        return {**estimates, "bytes_per_checkpoint": self.bytes_per_checkpoint}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Seed this session's estimates with a previous session's (see :meth:`Smoothed.seed`).

        Raises ``ValueError`` on a malformed state, before changing anything.
        """
        values = {name: state.get(name) for name in _SEEDED}
        for name, value in values.items():
            if value is not None and not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"profile {name!r} must be a non-negative number or null, got {value!r}")
        nbytes = state.get("bytes_per_checkpoint", 0)
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"profile 'bytes_per_checkpoint' must be a non-negative integer, got {nbytes!r}")
        for name, value in values.items():
            if value is not None:
                getattr(self, name).seed(float(value))
        self.bytes_per_checkpoint = nbytes

    @property
    def slowdown(self) -> float:
        """Relative slowdown of iterations that overlap a persist (0 when not measured)."""
        return interference(self.iteration.value, self.iteration_while_persisting.value)


_SEEDED = ("iteration", "iteration_while_persisting", "stall", "persist", "bandwidth", "checkpoint_cost")
"""The estimates a checkpoint carries into the next session."""


def _known(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _cost_estimate() -> Smoothed:
    return Smoothed(alpha=0.3, clip=4.0, band=0.5, shift_after=2, jump_up=True)


def interference(iteration: float, iteration_while_persisting: float) -> float:
    """``t_persisting / t_i − 1``, at least 0; 0 when either is unknown."""
    if not (iteration > 0 and iteration_while_persisting > 0):
        return 0.0
    return max(iteration_while_persisting / iteration - 1.0, 0.0)
