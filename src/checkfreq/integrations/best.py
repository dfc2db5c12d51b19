"""A framework's own "keep the best" options as a :class:`~checkfreq.Retention`: Lightning's
``monitor``/``mode``/``save_top_k``, the HF Trainer's ``metric_for_best_model``/``greater_is_better``."""

from __future__ import annotations

from checkfreq.errors import InvalidArgumentError
from checkfreq.policies.retention import Retention

ALL = 2**31 - 1
"""``save_top_k=-1``: every scored checkpoint is among the best kept."""


def best_retention(
    keep: int | Retention, metric: str | None, mode: str, top: int | None, names: tuple[str, str, str]
) -> int | Retention:
    """``keep`` keeping also the ``top`` best by ``metric`` (``mode``: ``"min"`` or ``"max"``); ``keep`` as
    it is when ``top`` is None or 0. ``names`` are the framework's names of (metric, mode, top), for the errors."""
    if top is None or top == 0:
        return keep
    if isinstance(top, bool) or not isinstance(top, int) or top < -1:
        raise InvalidArgumentError(f"{names[2]} must be an int >= -1 (-1: all), got {top!r}")
    if not metric:
        raise InvalidArgumentError(f"{names[2]}={top} keeps the best by a metric: name it with {names[0]}=")
    if mode not in ("min", "max"):
        raise InvalidArgumentError(f"{names[1]} must be 'min' or 'max', got {mode!r}")
    if isinstance(keep, Retention) and keep.best is not None:
        raise InvalidArgumentError(
            f"keep={keep!r} already keeps the best; give either it or {names[0]}=/{names[2]}=, not both"
        )
    base = keep if isinstance(keep, Retention) else Retention.of(keep)
    return Retention(base.keep, base.every, best=(metric, mode), top=ALL if top == -1 else top)


__all__ = ["ALL", "best_retention"]
