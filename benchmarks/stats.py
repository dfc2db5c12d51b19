"""Summaries of repeated measurements: medians, spread and ratios."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def median(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def spread(values: Sequence[float]) -> tuple[float, float]:
    """(min, max) of the finite values, or (nan, nan)."""
    finite = [v for v in values if math.isfinite(v)]
    return (min(finite), max(finite)) if finite else (math.nan, math.nan)


def ratio(a: float, b: float) -> float:
    return a / b if b and math.isfinite(a) and math.isfinite(b) else math.nan


def fmt_seconds(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "–"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def fmt_with_spread(values: Sequence[float]) -> str:
    """``median (min–max)`` of a list of seconds."""
    lo, hi = spread(values)
    if not math.isfinite(lo):
        return "–"
    return f"{fmt_seconds(median(values))} ({fmt_seconds(lo)}–{fmt_seconds(hi)})"


def fmt_ratio(value: float) -> str:
    return "–" if not math.isfinite(value) else f"{value:.2f}×"
