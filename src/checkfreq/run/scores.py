"""The score each checkpoint is ranked by, for a :class:`~checkfreq.Retention` that keeps the best.

A checkpoint's score is the value of the retention's metric *at its own step*, as the loop reports
it, taken at the checkpoint's capture and stored with it (the ``checkfreq`` entry of its state,
and, rank 0's, in its manifest: :mod:`checkfreq.pipeline.retention.best`). It comes from, in this order:

* ``ckpt.log(name=value)`` at that step (an evaluation's metric, logged after the evaluation);
* ``step(loss=…)`` at that step, for the metric ``"loss"``;
* a registered value ``ckpt[name]`` holding a number, as it is at the capture.

A metric logged by :meth:`Scores.log` describes the state of the step it was logged at, so it scores
only a checkpoint of that step: the checkpoints between two evaluations have no score, and are
kept only as the newest or as milestones, never as the best. ``log()`` of the retention's metric
makes sure a checkpoint of that step holds it (the Checkpointer takes one, or takes it again).
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from checkfreq.errors import InvalidArgumentError
from checkfreq.policies.retention import Retention

log = logging.getLogger("checkfreq")

SCORE_KEY = "score"
"""The key of a checkpoint's ``checkfreq`` entry (and of its manifest) that holds its score."""


def as_number(value: Any) -> float | None:
    """``value`` as a float if it is a real number (a one-element tensor or NumPy scalar too), else None."""
    if isinstance(value, torch.Tensor):
        value = value.detach().item() if value.numel() == 1 and not value.is_complex() else None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


class Scores:
    """What the loop reported of a run's metrics, and what each capture took (one per Checkpointer).

    Args:
        retention: the Checkpointer's ``keep``: its ``best`` names the metric a checkpoint is scored by.
    """

    def __init__(self, retention: Retention) -> None:
        self.retention = retention
        self._logged: dict[str, float] = {}
        self._logged_step: int | None = None
        self._loss: tuple[int, float] | None = None
        self._captured: int | None = None  # the step of the newest checkpoint's capture
        self._warned_non_finite = False

    def log(self, step: int, metrics: Mapping[str, Any]) -> bool:
        """Record ``metrics`` (name → number) as the values at ``step``; True if the retention's metric
        is among them (a checkpoint of ``step`` must then hold it)."""
        numbers_ = {}
        for name, value in metrics.items():
            number = as_number(value)
            if number is None:
                raise InvalidArgumentError(
                    f"log(): {name}={value!r} is not a number (an int, a float or a one-element tensor)"
                )
            numbers_[name] = number
            if not math.isfinite(number) and name == self.retention.metric and not self._warned_non_finite:
                self._warned_non_finite = True
                log.warning(
                    "log(): %s=%s at step %d is not a finite number: the checkpoint of that step is never "
                    "kept as the best by it",
                    name,
                    number,
                    step,
                )
        if step != self._logged_step:
            self._logged, self._logged_step = {}, step
        self._logged.update(numbers_)
        return self.retention.metric in numbers_

    def stepped(self, step: int, loss: Any) -> None:
        """``step(loss=…)`` at ``step``: the loss scores a checkpoint of that step for the metric ``"loss"``."""
        number = None if loss is None else as_number(loss)
        self._loss = None if number is None else (step, number)

    @property
    def captured_step(self) -> int | None:
        """The step of the newest checkpoint's capture (None before the first, or after a restore)."""
        return self._captured

    def entry(self, step: int, values: Mapping[str, Any], *, checkpoint: bool = True) -> dict[str, Any] | None:
        """The score a capture at ``step`` takes (None when the retention keeps no best):
        ``{"metric", "mode", "top", "value"}``, the value None when the metric has none at ``step``.
        ``checkpoint``: the capture is a checkpoint's (not a memory tier's snapshot, which retention never keeps)."""
        best = self.retention.best
        if best is None:
            return None
        if checkpoint:
            self._captured = step
        value = self.value_at(step, values)
        return {
            "metric": best[0],
            "mode": best[1],
            "top": self.retention.top,
            "value": None if value is None or not math.isfinite(value) else value,
        }

    def value_at(self, step: int, values: Mapping[str, Any]) -> float | None:
        """The retention's metric at ``step`` (see the module docstring for where it comes from)."""
        metric = self.retention.metric
        if metric is None:
            return None
        if self._logged_step == step and metric in self._logged:
            return self._logged[metric]
        if metric == "loss" and self._loss is not None and self._loss[0] == step:
            return self._loss[1]
        return as_number(values[metric]) if metric in values else None

    def forget(self) -> None:
        """A restore or ``start_at``: what this session logged is not of the state it now holds."""
        self._logged, self._logged_step, self._loss, self._captured = {}, None, None, None


__all__ = ["SCORE_KEY", "Scores", "as_number"]
