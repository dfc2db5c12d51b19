"""What every policy shares: the :class:`DecisionContext` it reads, the :class:`Policy` and
:class:`StatefulPolicy` protocols, and the checks a policy's saved state goes through."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from checkfreq.errors import InvalidArgumentError


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
    """What a checkpoint cost the loop, measured: its stall plus the extra time of the iterations its
    persist overlapped."""
    away: float = 0.0
    """Seconds of :attr:`elapsed` the loop spent between steps on other work than training and
    checkpointing (an evaluation, an epoch's end), as the profiler tells them apart: not overhead."""
    away_since_checkpoint: float = 0.0
    """The part of :attr:`away` within :attr:`seconds_since_checkpoint`."""


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


def measured(x: float) -> bool:
    return x > 0 and math.isfinite(x)


def params_of(policy: Any) -> dict[str, Any]:
    """The constructor arguments of a dataclass policy: the configuration its state belongs to."""
    return {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if f.init}


def check_params(policy: Any, state: Mapping[str, Any]) -> None:
    saved, current = state.get("params"), params_of(policy)
    if saved != current:
        raise InvalidArgumentError(
            f"state saved by {type(policy).__name__}({saved}), this run uses {type(policy).__name__}({current})"
        )


def state_number(state: Mapping[str, Any], key: str, *, low: float = 0.0) -> float:
    """A saved finite number >= ``low``; ``None`` (not measured) reads as NaN."""
    value = state.get(key)
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= low):
        raise InvalidArgumentError(f"{key!r} must be a finite number >= {low:g} or null, got {value!r}")
    return float(value)


def state_count(state: Mapping[str, Any], key: str) -> int:
    value = state.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"{key!r} must be a non-negative integer, got {value!r}")
    return value


def state_text(state: Mapping[str, Any], key: str) -> str:
    value = state.get(key)
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{key!r} must be a string, got {value!r}")
    return value


def state_numbers(state: Mapping[str, Any], key: str) -> list[float]:
    values = state.get(key)
    if not isinstance(values, list):
        raise InvalidArgumentError(f"{key!r} must be a list of numbers, got {type(values).__name__}")
    return [state_number({key: v}, key, low=-math.inf) for v in values]


def finite_or_none(x: float) -> float | None:
    """``x`` as a float, or None where it is inf or nan (a policy's state is strict JSON)."""
    return float(x) if math.isfinite(x) else None
