"""Fixed cadences: every ``n`` steps or seconds (:class:`Every`), every epoch (:class:`EveryEpoch`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from checkfreq.errors import InvalidArgumentError
from checkfreq.policies.base import DecisionContext, check_params, params_of


@dataclass
class Every:
    """Checkpoint every ``n`` steps, or every ``seconds`` of wall time (give exactly one).

    ``seconds`` count from the last checkpoint or the restore; a checkpoint due while the previous
    one is still being written waits for it to be durable (it would only block the loop). With
    ``n``, a checkpoint due while the previous persist runs blocks until it ends, with a warning
    and an event (:mod:`checkfreq.run.busy`): the steps asked are kept.
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
        return {"params": params_of(self)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_params(self, state)


@dataclass
class EveryEpoch:
    """Checkpoint at the first step of every new epoch (the epoch of a registered loader)."""

    def should_save(self, ctx: DecisionContext) -> bool:
        return ctx.epoch_changed
