"""The busy-storage rule: a checkpoint (or memory snapshot) falls due while the previous one is still
being written.

The host buffer (or memory slot) of the previous checkpoint is still in use, so the new one must
wait for it or come later. Measured on an H100 with a fixed ``policy=10`` (2.2 s between
checkpoints) and a persist of 8.5-16.8 s, every checkpoint stalled 8.5-9.1 s and the mean step
became 5.3 times longer, and nothing said so. The rule (docs/policies.md, "When storage is busy"):
the checkpoint **waits**, because a fixed interval is a promise of how many steps a crash may lose
(and, under torch.distributed, of the steps every rank checkpoints without exchanging a message);
coming later would break that promise without the user asking. What must not happen is the wait
going unnoticed: the first one logs a warning with the figures (how long a persist takes here, at
what bandwidth, the interval asked, how long training waited) and what to do, and every wait is an
event (``"busy"``: docs/cli.md) that ``checkfreq report`` and the policy's cost see. ``policy="auto"``
never asks while a persist is in flight, so it never waits. A checkpoint that ``log()``, ``save()`` or
``close()`` takes waits the same way and is an event too, but warns of nothing: no interval is at stake.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from checkfreq.policies.profiler import Profiler
from checkfreq.run.events import EventLog
from checkfreq.run.units import human_rate

log = logging.getLogger("checkfreq.busy")

PERSIST = "persist"
MEMORY = "memory"


def busy_advice(
    what: str, profiler: Profiler, interval_steps: int | None, action: str, *, outlasted: float | None = None
) -> str:
    """The warning of the rule: what was asked, what storage does here, what happens, what to do.
    ``outlasted``: seconds the previous persist has been running when it is finally done (from its
    checkpoint to the end of the wait), so the interval advised is longer than the one that waited."""
    iteration = profiler.iteration.value
    took = profiler.persist.value
    if what == PERSIST:
        rate = profiler.bandwidth.value
        measured = f"a persist takes {took:.2f} s here" if math.isfinite(took) else "the first persist is still running"
        if math.isfinite(rate) and math.isfinite(took):
            measured += f" ({human_rate(rate)})"
        if outlasted is not None and (not math.isfinite(took) or outlasted > took):
            measured += f", and the previous one took {outlasted:.2f} s"
            took = outlasted
        thing = "checkpoint"
    else:
        measured, thing = "the previous memory snapshot's copy and checksum are still running", "memory snapshot"
    asked = ""
    if interval_steps is not None:
        seconds = f", {interval_steps * iteration:.2f} s" if math.isfinite(iteration) else ""
        asked = f" (every {interval_steps} steps{seconds})"
    advice = "a longer interval, policy='auto' (it never waits for a persist), or faster storage"
    if what == PERSIST and math.isfinite(iteration) and iteration > 0 and math.isfinite(took):
        fits = max(math.ceil(took / iteration) + 1, (interval_steps or 0) + 1)
        advice = f"an interval of at least {fits} steps, " + advice
    if what == MEMORY:
        advice = "a larger memory= interval, memory=True (it spaces snapshots out by their cost), or the GPU staging"
    return f"a {thing} is due{asked} while the previous one is still being written: {measured}. {action} Use {advice}."


class BusyStorage:
    """Applies the rule for one Checkpointer: waits, records each wait, warns once per kind."""

    def __init__(self, events: EventLog) -> None:
        self._events = events
        self._warned: set[str] = set()

    def wait(
        self,
        what: str,
        step: int,
        busy: bool,
        wait: Callable[[], Any],
        profiler: Profiler,
        interval_steps: int | None = None,
        *,
        asked: bool = True,
        since_previous: float | None = None,
    ) -> float:
        """Call ``wait`` (until the previous ``what`` is written) and return how long it took; if
        storage was ``busy``, the wait is an event, and the first such wait of a snapshot the user's
        cadence ``asked`` for a warning (a retake by ``log()``, ``save()`` or ``close()`` is not what an
        interval decides). ``since_previous``: seconds since the previous checkpoint began."""
        if not busy:
            wait()
            return 0.0
        start = time.perf_counter()
        wait()
        waited = time.perf_counter() - start
        self._events.write(
            "busy", step=step, waiting_for=what, wait_s=waited, interval_steps=interval_steps, **_figures(profiler)
        )
        if asked and what not in self._warned and waited >= noticeable(profiler):
            self._warned.add(what)
            log.warning(
                "step %d: %s",
                step,
                busy_advice(
                    what,
                    profiler,
                    interval_steps,
                    f"Training waited {waited:.2f} s for it, and will at each such step.",
                    outlasted=None if since_previous is None else since_previous + waited,
                ),
            )
        return waited


def noticeable(profiler: Profiler) -> float:
    """A wait this long is worth a warning: a tenth of a step, and at least 10 ms."""
    iteration = profiler.iteration.value
    return max(0.01, 0.1 * iteration) if math.isfinite(iteration) else 0.01


def _figures(profiler: Profiler) -> dict[str, float]:
    rate = profiler.bandwidth.value
    return {"persist_s": profiler.persist.value, "bandwidth_gbps": rate / 1e9 if math.isfinite(rate) else math.nan}
