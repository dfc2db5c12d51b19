"""From raw samples to the figures in the report: medians, per-round ratios, targets."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from benchmarks.stats import median, ratio, spread

RAW_COPY = "raw copy_ (preallocated)"
RAW_WRITE = "raw write+fsync"
RAW_READ = {"hot": "raw read (hot cache)", "cold": "raw read (cold cache)"}
RESTORE = {"hot": "checkfreq restore (hot cache)", "cold": "checkfreq restore (cold cache)"}
CHECKFREQ = "checkfreq"
TORCH_SAVE = "torch.save+fsync"
DCP_ASYNC_PREFIX = "DCP async_save"


@dataclass(frozen=True)
class Target:
    """One target of the issue, as measured: ``value`` compared with ``bound`` (``>=`` or ``<=``)."""

    what: str
    values: list[float]
    bound: float
    at_least: bool

    @property
    def value(self) -> float:
        return median(self.values)

    @property
    def met(self) -> bool | None:
        if not math.isfinite(self.value):
            return None
        return self.value >= self.bound if self.at_least else self.value <= self.bound


def field(result: dict[str, Any], method: str, key: str) -> list[float]:
    return [s[key] for s in result["samples"].get(method, [])]


def bandwidth(result: dict[str, Any], method: str) -> list[float]:
    """Bytes per second of the write (two-phase methods: the write after the snapshot) or read."""
    nbytes = result["nbytes"]
    out = []
    for s in result["samples"].get(method, []):
        seconds = (
            s["write"] if math.isfinite(s["write"]) else s["durable"] if math.isfinite(s["durable"]) else s["stall"]
        )
        out.append((s["nbytes"] or nbytes) / seconds if seconds > 0 else math.nan)
    return out


def per_round(a: list[float], b: list[float]) -> list[float]:
    """``a[r] / b[r]`` for each interleaved round ``r``."""
    return [ratio(x, y) for x, y in zip(a, b, strict=False)]


def dcp_async_best(result: dict[str, Any]) -> str | None:
    names = [n for n in result["samples"] if n.startswith(DCP_ASYNC_PREFIX) and result["samples"][n]]
    return min(names, key=lambda n: median(field(result, n, "stall"))) if names else None


def state_targets(result: dict[str, Any], memory: dict[str, float] | None) -> list[Target]:
    """The issue's per-state targets, each as per-round ratios."""
    stall = field(result, CHECKFREQ, "stall")
    targets = [
        Target("stall / raw copy_", per_round(stall, field(result, RAW_COPY, "stall")), 1.3, False),
        Target(
            "torch.save+fsync stall / checkfreq stall", per_round(field(result, TORCH_SAVE, "stall"), stall), 10, True
        ),
    ]
    best = dcp_async_best(result)
    if best:
        targets.append(
            Target(f"{best} stall / checkfreq stall", per_round(field(result, best, "stall"), stall), 2, True)
        )
    targets.append(
        Target(
            "write bandwidth / raw write+fsync",
            per_round(bandwidth(result, CHECKFREQ), bandwidth(result, RAW_WRITE)),
            0.9,
            True,
        )
    )
    for cache in ("hot", "cold"):
        if RESTORE[cache] not in result["samples"]:
            continue
        targets.append(
            Target(
                f"restore / raw read ({cache} cache), bandwidth",
                per_round(field(result, RAW_READ[cache], "stall"), field(result, RESTORE[cache], "stall")),
                0.8,
                True,
            )
        )
    if memory:
        targets.append(
            Target("peak extra RSS (save) / state size", [memory["save_peak_extra"] / memory["nbytes"]], 1.1, False)
        )
        targets.append(
            Target(
                "peak extra RSS (restore) / state size", [memory["restore_peak_extra"] / memory["nbytes"]], 1.1, False
            )
        )
    return targets


# ---------------------------------------------------------------- training loop


def mean_iteration(run: dict[str, Any]) -> float:
    durations = [e - b for b, e in run["spans"][1:]]
    return statistics.fmean(durations) if durations else math.nan


def persisting_iterations(run: dict[str, Any]) -> list[float]:
    """Durations of iterations that overlapped a persist, minus those that held a checkpoint's stall."""
    stalled = {s for i in run["checkpoint_steps"] for s in (i, i + 1)}
    return [
        e - b
        for k, ((b, e), busy) in enumerate(zip(run["spans"], run["persisting"], strict=False))
        if busy and k not in stalled
    ]


@dataclass(frozen=True)
class LoopRow:
    name: str
    overhead: list[float]
    """Per run: mean iteration time / the mean of its neighbouring no-checkpoint runs − 1."""
    stalls: list[float]
    persisting_slowdown: list[float]
    """Per run: median iteration time while persisting / its no-checkpoint neighbours' median − 1."""
    checkpoints: float


def _reference(run: dict[str, Any], nones: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The no-checkpoint runs a variant run is compared with: its two neighbours (or its round's)."""
    if "ref" in run:
        return [n for n in nones if n["seq"] in run["ref"]]
    return [n for n in nones if n.get("round") == run["round"]]


def loop_rows(training: dict[str, Any]) -> list[LoopRow]:
    runs = training["runs"]
    nones = runs["no checkpoints"]
    rows = []
    for name, variant_runs in runs.items():
        if name == "no checkpoints":
            continue
        overhead, slowdown, stalls, counts = [], [], [], []
        for run in variant_runs:
            refs = _reference(run, nones)
            ref_mean = statistics.fmean(mean_iteration(r) for r in refs)
            overhead.append(ratio(mean_iteration(run), ref_mean) - 1)
            busy = persisting_iterations(run)
            ref_median = median([e - b for r in refs for b, e in r["spans"][1:]])
            slowdown.append(ratio(median(busy), ref_median) - 1 if busy else math.nan)
            stalls += run["stalls"]
            counts.append(len(run["checkpoint_steps"]))
        rows.append(LoopRow(name, overhead, stalls, slowdown, median(counts)))
    return rows


def auto_target(rows: list[LoopRow]) -> Target | None:
    for row in rows:
        if row.name.startswith("checkfreq auto"):
            return Target(f"{row.name}: whole-run overhead", row.overhead, 0.035, False)
    return None


def fmt_range(values: list[float], scale: float = 1.0, suffix: str = "") -> str:
    lo, hi = spread(values)
    if not math.isfinite(lo):
        return "–"
    return f"{median(values) * scale:.2f}{suffix} ({lo * scale:.2f}–{hi * scale:.2f})"
