"""The schedule each policy produces on a simulated :class:`~checkfreq.tools.simulate.Workload`.

Our policies use the same math as their online versions in :mod:`checkfreq.policies`; the
*published* CheckFreq and COCI rules live here only, as baselines to compare against.
"""

from __future__ import annotations

import math

import numpy as np

from checkfreq.errors import InvalidArgumentError
from checkfreq.policies import Overhead
from checkfreq.policies.intervals import convergence_interval, overhead_steps, place, place_optimal, two_phase_interval
from checkfreq.policies.losscurve import LossCurve, fit_exponential
from checkfreq.tools.simulate import Schedule, Workload


def every(wl: Workload, interval: float) -> Schedule:
    """A checkpoint every ``interval`` seconds of work, rounded to whole iterations."""
    if not interval > 0:
        raise InvalidArgumentError(f"interval must be positive, got {interval!r}")
    step = max(round(interval / wl.iteration), 1) * wl.iteration
    return Schedule(np.arange(step, wl.work, step))


def epoch_level(wl: Workload) -> Schedule:
    return every(wl, wl.epoch)


def young_daly(wl: Workload, method: str = "daly") -> Schedule:
    """Failure-optimal uniform interval for the stall, at least the persist time."""
    return every(wl, two_phase_interval(wl.stall, wl.persist, wl.mtbf, method=method))


def overhead(wl: Workload, p: float = 0.035) -> Schedule:
    """Our ``Overhead(p)`` in steady state: persist keeps up and stalls cost at most ``target·p``."""
    return every(wl, overhead_steps(wl.iteration, wl.stall, wl.persist, Overhead.target * p) * wl.iteration)


def auto(wl: Workload, p: float = 0.035, mtbf: float | None = None) -> Schedule:
    """Our ``Auto``: the failure-optimal interval, but never more stall overhead than ``target·p``."""
    floor = overhead_steps(wl.iteration, wl.stall, wl.persist, Overhead.target * p) * wl.iteration
    if mtbf is None:
        return every(wl, floor)
    return every(wl, max(floor, two_phase_interval(wl.stall, wl.persist, mtbf)))


def convergence_aware(wl: Workload, beta: float = 1.0) -> Schedule:
    """Closed-form value-weighted placement from the workload's loss curve."""
    curve = _curve(wl)
    return Schedule(
        place(
            lambda t: convergence_interval(
                t, curve, wl.work, stall=wl.stall, persist=wl.persist, mtbf=wl.mtbf, iteration=wl.iteration, beta=beta
            ),
            wl.work,
        )
    )


def convergence_optimal(wl: Workload, resolution: float = 60.0) -> Schedule:
    """Exact value-weighted placement (dynamic program on a grid of ``resolution`` seconds)."""
    curve = _curve(wl)
    step = max(round(resolution / wl.iteration), 1) * wl.iteration
    grid = np.append(np.arange(0.0, wl.work, step), wl.work)
    rate = np.full(len(grid), 1.0 / wl.mtbf)
    for position, multiplier in wl.rate_changes:
        rate[grid >= position] = multiplier / wl.mtbf
    survival = _survival(grid, wl)
    window = max(int(4 * wl.mtbf / step), 2)
    return Schedule(
        place_optimal(
            grid,
            stall=wl.stall,
            persist=wl.persist,
            restart=wl.restart,
            rate=rate,
            weight=np.asarray(curve.weight(grid, wl.work)),
            survival=survival,
            window=window,
        )
    )


def checkfreq_published(wl: Workload, p: float = 0.035) -> Schedule:
    """CheckFreq's reference rule: ``k = ceil(C_p / t_i)``, then ``k += 2`` while a window's overhead exceeds ``p``.

    The tuned ``k`` is not saved with the checkpoint, so after every restart the run starts over
    from the profiled ``k`` (relative schedule); the first ``profile_steps`` take no checkpoint.
    """
    full_checkpoint = wl.stall + wl.persist  # t_f, profiled once
    k = max(math.ceil((full_checkpoint - wl.stall) / wl.iteration), 1)
    offsets = []
    position = k * wl.iteration
    while position < wl.work:
        offsets.append(position)
        if wl.stall / (k * wl.iteration) > p:  # the window's measured overhead
            k += 2
        position += k * wl.iteration
    return Schedule(np.asarray(offsets), absolute=False)


def coci_published(wl: Workload, unit: float = 60.0) -> Schedule:
    """COCI's published rule: a checkpoint each time the loss drops by ``P_e``.

    ``P_e = (1 − e^(θ1·C_b))·(1/(2λ) − 1/(2θ1))`` with ``L = exp(θ1·w + θ2)`` fitted to the loss,
    and times expressed in ``unit`` seconds. It is not unit-consistent: changing ``unit`` changes
    the placement. Kept only as a baseline.
    """
    curve = _curve(wl)
    w = np.linspace(0.0, wl.work, 200)
    theta1, _ = fit_exponential(w / unit, np.asarray(curve.value(w)))
    if theta1 >= 0:
        return Schedule(np.empty(0))
    drop = -math.expm1(theta1 * wl.stall / unit) * (wl.mtbf / unit / 2.0 - 1.0 / (2.0 * theta1))
    start = float(curve.value(0.0))
    levels = start - drop * np.arange(1, int((start - float(curve.value(wl.work))) / drop) + 1)
    fine = np.linspace(0.0, wl.work, 100_001)
    positions = np.interp(-levels, -np.asarray(curve.value(fine)), fine)
    snapped = np.unique(np.round(positions / wl.iteration) * wl.iteration)
    return Schedule(snapped[(snapped > 0) & (snapped < wl.work)])


def _curve(wl: Workload) -> LossCurve:
    if wl.loss is None:
        raise InvalidArgumentError("this policy needs a workload with a loss curve")
    return wl.loss


def _survival(grid: np.ndarray, wl: Workload) -> np.ndarray:
    """Probability the job is still running at ``grid``, from the early-stop law ``q·U(0.4, 0.6)·W``."""
    stopped_by = np.clip((grid / wl.work - 0.4) / 0.2, 0.0, 1.0)
    return 1.0 - wl.stop_probability * stopped_by
