"""Sizes and rates in the decimal unit a person reads at a glance: ``801 kB``, ``52.3 MB/s``."""

from __future__ import annotations

import math

_UNITS = ("B", "kB", "MB", "GB", "TB")


def human_bytes(nbytes: float | None) -> str:
    """A size in decimal units: ``812 B``, ``1.25 MB``; ``n/a`` for None."""
    if nbytes is None or not math.isfinite(nbytes):
        return "n/a"
    if nbytes < 1000:
        return f"{int(nbytes)} B"
    value, unit = float(nbytes), _UNITS[0]
    for unit in _UNITS[1:]:  # noqa: B007 - the unit the loop stops at is the answer
        value /= 1000
        if value < 1000:
            break
    return f"{value:.3g} {unit}"


def human_rate(bytes_per_second: float | None) -> str:
    """A bandwidth in the decimal unit that keeps three significant digits readable: ``52.3 MB/s``,
    ``1.45 GB/s``, ``261 kB/s``; ``n/a`` for None."""
    if bytes_per_second is None or not math.isfinite(bytes_per_second):
        return "n/a"
    if bytes_per_second < 1000:
        return f"{bytes_per_second:.3g} B/s"
    return f"{human_bytes(bytes_per_second)}/s"
