"""The default policy (:class:`Auto`), and the ``policy=`` argument turned into a policy (:func:`resolve`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from checkfreq.errors import ArgumentTypeError, InvalidArgumentError
from checkfreq.policies.base import DecisionContext, Policy, check_params, params_of
from checkfreq.policies.failures import YoungDaly
from checkfreq.policies.fixed import Every
from checkfreq.policies.overhead import Overhead


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
        return {"params": params_of(self), "overhead": self.overhead.state_dict(), "failures": failures}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_params(self, state)
        overhead, failures = state.get("overhead"), state.get("failures")
        if not isinstance(overhead, Mapping) or (self.failures is not None) != isinstance(failures, Mapping):
            raise InvalidArgumentError("Auto's state needs its 'overhead' state (and 'failures' with an mtbf)")
        fresh = Overhead(self.p)
        fresh.load_state_dict(overhead)  # validated in full before anything here changes
        if self.failures is not None:
            self.failures.load_state_dict(failures)  # type: ignore[arg-type]
        self.overhead = fresh


def resolve(policy: Policy | str | int) -> Policy:
    """Turn the Checkpointer's ``policy=`` argument into a policy object."""
    if isinstance(policy, int) and not isinstance(policy, bool):
        return Every(policy)
    if policy == "auto":
        return Auto()
    if isinstance(policy, Policy):
        return policy
    raise ArgumentTypeError(f"policy must be a Policy, an int (every n steps) or 'auto', got {policy!r}")
