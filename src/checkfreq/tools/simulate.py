"""Event-driven Monte Carlo failure simulator for comparing checkpoint policies (docs/algorithms.md §4).

Time is measured in failure-free work ``w`` (seconds of training progress) and wall time ``t``.
A run trains up to ``W`` (or up to an early stop), stalls ``C_b`` per checkpoint, waits for the
previous persist if it has not finished, and takes a final checkpoint at the end. Each checkpoint
becomes durable ``C_p`` after its stall. A failure rolls back to the last *durable* checkpoint and
pays the restart ``R``; a failure during a restart starts it over. All runs are simulated at once
(vectorised over runs), and every policy faces the same failures (common random numbers): the
``k``-th failure of run ``r`` is drawn from the same unit exponential for every policy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from checkfreq.errors import InvalidArgumentError
from checkfreq.policies.losscurve import LossCurve


@dataclass(frozen=True)
class Workload:
    """The job and its costs; seconds throughout."""

    work: float
    """Failure-free training time ``W``."""
    iteration: float
    stall: float
    persist: float
    restart: float
    mtbf: float
    """Job MTBF ``M`` (with ``g`` workers of MTBF ``M_1`` each, ``M = M_1 / g``)."""
    gpus: int = 1
    epoch: float = 3600.0
    """Failure-free seconds per epoch (for the epoch-level policy)."""
    stop_probability: float = 0.0
    """``q``: probability that the job is stopped early, at ``U(0.4, 0.6)·W``."""
    loss: LossCurve | None = None
    """Loss as a function of ``w`` (seconds); values lost work when given."""
    rate_changes: tuple[tuple[float, float], ...] = ()
    """``(position, multiplier)`` pairs: from that work position on, the failure rate is ``multiplier / mtbf``."""

    def __post_init__(self) -> None:
        for name in ("work", "iteration", "mtbf", "epoch"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise InvalidArgumentError(f"Workload.{name} must be a positive number, got {value!r}")
        for name in ("stall", "persist", "restart"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise InvalidArgumentError(f"Workload.{name} must be a non-negative number, got {value!r}")
        if self.gpus < 1:
            raise InvalidArgumentError(f"Workload.gpus must be >= 1, got {self.gpus}")
        if not 0.0 <= self.stop_probability <= 1.0:
            raise InvalidArgumentError(f"Workload.stop_probability must lie in [0, 1], got {self.stop_probability}")
        if any(m <= 0 for _, m in self.rate_changes):
            raise InvalidArgumentError("Workload.rate_changes multipliers must be positive")


@dataclass(frozen=True)
class Schedule:
    """Where a policy checkpoints, in work positions.

    ``absolute``: the checkpoint positions themselves (a roll-back resumes the same list).
    Otherwise ``points`` are offsets from the start of the run *and from every restart* (a policy
    whose state is lost on failure, like CheckFreq-as-published re-tuning from scratch).
    """

    points: np.ndarray
    absolute: bool = True


@dataclass(frozen=True)
class Result:
    """Per-policy means over runs (seconds unless stated) and the spread of the total."""

    name: str
    stall: float
    lost: float
    recovery: float
    overhead: float
    overhead_std: float
    value_weighted: float
    """``J``: stall + recovery + lost work valued by ``ω`` (equals ``overhead`` without a loss curve)."""
    gpu_hours: float
    checkpoints: float
    failures: float
    runs: int
    placement: np.ndarray = field(repr=False)

    def as_dict(self) -> dict[str, float | int | str]:
        return {k: v for k, v in self.__dict__.items() if k != "placement"}


class _Hazard:
    """Piecewise-constant failure rate over work position; cumulative hazard and its inverse."""

    def __init__(self, workload: Workload) -> None:
        changes = sorted((float(p), float(m)) for p, m in workload.rate_changes if 0 < p < workload.work)
        self.breaks = np.array([0.0] + [p for p, _ in changes])
        self.rates = np.array([1.0] + [m for _, m in changes]) / workload.mtbf
        ends = np.append(self.breaks[1:], workload.work * 4.0)
        self.xs = np.append(self.breaks, ends[-1])
        self.hs = np.concatenate(([0.0], np.cumsum(self.rates * (ends - self.breaks))))

    def rate(self, w: np.ndarray) -> np.ndarray:
        return self.rates[np.searchsorted(self.breaks, w, side="right") - 1]

    def cumulative(self, w: np.ndarray) -> np.ndarray:
        return np.interp(w, self.xs, self.hs)

    def position(self, h: np.ndarray) -> np.ndarray:
        return np.interp(h, self.hs, self.xs)


class _Failures:
    """Unit exponentials per run, identical for every policy given the seed; extended on demand."""

    def __init__(self, runs: int, seed: int) -> None:
        self.runs, self.seed = runs, seed
        self.draws = np.empty((runs, 0))

    def get(self, rows: np.ndarray, k: np.ndarray) -> np.ndarray:
        while k.max(initial=-1) >= self.draws.shape[1]:
            chunk = np.random.default_rng([self.seed, 1, self.draws.shape[1]]).exponential(size=(self.runs, 64))
            self.draws = np.hstack((self.draws, chunk))
        return self.draws[rows, k]


def simulate(workload: Workload, schedules: dict[str, Schedule], *, runs: int = 2000, seed: int = 0) -> list[Result]:
    """Simulate ``runs`` paired runs of each schedule; results in the order given."""
    if runs < 1:
        raise InvalidArgumentError(f"runs must be >= 1, got {runs}")
    stops = np.random.default_rng([seed, 0]).random((runs, 2))
    end = np.where(stops[:, 0] < workload.stop_probability, (0.4 + 0.2 * stops[:, 1]) * workload.work, workload.work)
    failures = _Failures(runs, seed)
    hazard = _Hazard(workload)
    return [_run(name, s, workload, end, failures, hazard) for name, s in schedules.items()]


def _run(name: str, schedule: Schedule, wl: Workload, end: np.ndarray, failures: _Failures, hazard: _Hazard) -> Result:
    n = len(end)
    rows = np.arange(n)
    pts = np.append(np.sort(np.asarray(schedule.points, dtype=float)), np.inf)
    loss = wl.loss
    value = (
        (lambda w: np.asarray(loss.cumulative_weight(w, wl.work), dtype=float))
        if loss is not None
        else (lambda w: np.asarray(w, dtype=float))
    )
    t, w, durable, base = (np.zeros(n) for _ in range(4))
    pend_w = np.full(n, np.nan)
    pend_t = np.full(n, -np.inf)  # no checkpoint in flight
    j = np.zeros(n, dtype=int)
    k = np.zeros(n, dtype=int)
    h = failures.get(rows, k)
    stall, lost, lost_value, recovery, ckpts, fails = (np.zeros(n) for _ in range(6))
    active = np.ones(n, dtype=bool)

    while active.any():
        r = np.flatnonzero(active)
        nxt = base[r] + pts[j[r]]
        final = nxt >= end[r]
        target = np.minimum(nxt, end[r])
        need = hazard.cumulative(target) - hazard.cumulative(w[r])
        dies = h[r] < need
        # Failure while training: find where, then roll back.
        f = r[dies]
        wf = hazard.position(hazard.cumulative(w[f]) + h[f])
        tf = t[f] + (wf - w[f])
        # Reached the next checkpoint (or the end): pay the wait for the previous persist and the stall.
        ok = r[~dies]
        t[ok] += target[~dies] - w[ok]
        h[ok] -= need[~dies]
        w[ok] = target[~dies]
        saving = ok[~final[~dies] | (end[ok] >= wl.work)]
        early = ok[final[~dies] & (end[ok] < wl.work)]
        active[early] = False
        block = np.maximum(pend_t[saving] - t[saving], 0.0) + wl.stall
        block += np.where(w[saving] >= wl.work, wl.persist, 0.0)  # the last checkpoint must be durable
        lam = hazard.rate(w[saving])
        dies_blocked = h[saving] < lam * block
        g = saving[dies_blocked]
        tg = t[g] + h[g] / lam[dies_blocked]
        s = saving[~dies_blocked]
        stall[s] += block[~dies_blocked]
        t[s] += block[~dies_blocked]
        h[s] -= lam[~dies_blocked] * block[~dies_blocked]
        _settle(s, t[s], durable, pend_w, pend_t)
        pend_w[s], pend_t[s] = w[s], t[s] + np.where(w[s] >= wl.work, 0.0, wl.persist)
        ckpts[s] += 1
        j[s] += 1
        done = s[w[s] >= wl.work]
        active[done] = False
        stall[g] += tg - t[g]
        hit = np.concatenate((f, g))
        if hit.size:
            at = np.concatenate((wf, w[g]))
            when = np.concatenate((tf, tg))
            _settle(hit, when, durable, pend_w, pend_t)
            pend_w[hit], pend_t[hit] = np.nan, -np.inf
            lost[hit] += at - durable[hit]
            lost_value[hit] += value(at) - value(durable[hit])
            fails[hit] += 1
            w[hit] = durable[hit]
            t[hit] = when + _recover(hit, hazard.rate(durable[hit]), wl.restart, k, h, failures, recovery)
            if schedule.absolute:
                j[hit] = np.searchsorted(pts, durable[hit], side="right")
            else:
                base[hit], j[hit] = durable[hit], 0

    overhead = stall + lost + recovery
    return Result(
        name=name,
        stall=float(stall.mean()),
        lost=float(lost.mean()),
        recovery=float(recovery.mean()),
        overhead=float(overhead.mean()),
        overhead_std=float(overhead.std()),
        value_weighted=float((stall + recovery + lost_value).mean()),
        gpu_hours=float(overhead.mean()) * wl.gpus / 3600.0,
        checkpoints=float(ckpts.mean()),
        failures=float(fails.mean()),
        runs=n,
        placement=np.asarray(schedule.points, dtype=float),
    )


def _settle(rows: np.ndarray, now: np.ndarray, durable: np.ndarray, pend_w: np.ndarray, pend_t: np.ndarray) -> None:
    """Checkpoints whose persist finished by ``now`` become the roll-back point."""
    ready = (pend_t[rows] <= now) & ~np.isnan(pend_w[rows])
    durable[rows[ready]] = pend_w[rows[ready]]


def _recover(
    rows: np.ndarray,
    lam: np.ndarray,
    restart: float,
    k: np.ndarray,
    h: np.ndarray,
    failures: _Failures,
    recovery: np.ndarray,
) -> np.ndarray:
    """Draw the next failures, restarting the recovery while one strikes during it; returns its duration."""
    spent = np.zeros(len(rows))
    pending = np.ones(len(rows), dtype=bool)
    while pending.any():
        i = np.flatnonzero(pending)
        rr = rows[i]
        k[rr] += 1
        h[rr] = failures.get(rr, k[rr])
        fails_again = h[rr] < lam[i] * restart
        spent[i] += np.where(fails_again, h[rr] / lam[i], restart)
        h[rr] = np.where(fails_again, h[rr], h[rr] - lam[i] * restart)
        pending[i] = fails_again
    recovery[rows] += spent
    return spent


def relative_change(results: Sequence[Result], reference: str) -> dict[str, tuple[float, float]]:
    """Per policy, the relative change of (time overhead, value-weighted J) against ``reference``."""
    ref = next((r for r in results if r.name == reference), None)
    if ref is None:
        raise InvalidArgumentError(f"no result named {reference!r}")
    return {r.name: (r.overhead / ref.overhead - 1.0, r.value_weighted / ref.value_weighted - 1.0) for r in results}
