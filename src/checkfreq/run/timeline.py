"""Where a training session stands: steps counted, the last checkpoint, the clean iterations since.

The Checkpointer keeps one :class:`Timeline` per session (a restore starts a new one) and asks it
for the :class:`~checkfreq.policies.DecisionContext` each policy decision reads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from checkfreq.policies import DecisionContext
from checkfreq.policies.profiler import Profiler


@dataclass
class Timeline:
    """One session's steps and checkpoints, on the ``time.perf_counter()`` clock."""

    step: int = 0
    """The global step: optimizer steps counted, from the restored one on."""
    session_start: int = 0
    """The global step this session started from (its restore)."""
    last_checkpoint: int = 0
    started: float = field(default_factory=time.perf_counter)
    last_checkpoint_time: float = 0.0
    clean_count: int = 0
    """Iterations since the last checkpoint that no stall or persist overlapped."""
    clean_seconds: float = 0.0
    away_seconds: float = 0.0
    """Seconds of the steps since the last checkpoint spent on other work (:meth:`set_aside`)."""
    _last_step_time: float | None = None
    _last_clean: bool = False
    _transitions: int = 0
    _last_epoch: int | None = None

    def __post_init__(self) -> None:
        self.last_checkpoint_time = self.last_checkpoint_time or self.started

    @classmethod
    def restored(cls, step: int) -> Timeline:
        """A session starting at ``step`` (the restored checkpoint's)."""
        return cls(step=step, session_start=step, last_checkpoint=step)

    def advance(self, now: float, *, writer_busy: bool, writer_transitions: int) -> tuple[float, bool] | None:
        """Count one optimizer step ending at ``now``; return its seconds and whether a persist
        overlapped any part of it (even one that ended within it), or None for a session's first step."""
        self.step += 1
        measured = None
        if self._last_step_time is not None:
            seconds = now - self._last_step_time
            persisting = writer_busy or writer_transitions != self._transitions
            self._last_clean = not persisting and self.step - self.last_checkpoint > 1  # the first holds the stall
            if self._last_clean:
                self.clean_count, self.clean_seconds = self.clean_count + 1, self.clean_seconds + seconds
            measured = (seconds, persisting)
        self._last_step_time, self._transitions = now, writer_transitions
        return measured

    def set_aside(self, seconds: float) -> None:
        """``seconds`` of the step just counted were other work than training (the profiler's
        ``away``): not part of the clean iterations' time."""
        self.away_seconds += seconds
        if self._last_clean:
            self.clean_seconds -= seconds

    def reached_point(self, now: float, profiler: Profiler) -> None:
        """The consistent point of the current step came at ``now``, where a capture begins. The loop's
        work since ``step()`` is the next iteration's (loading a batch, the host's part of a step)
        unless the profiler finds it other work (an evaluation): that is left out of the next
        iteration. The capture's stall is left out by the profiler itself."""
        if self._last_step_time is None:
            return
        away = profiler.record_between(max(now - self._last_step_time, 0.0))
        if away:
            self.away_seconds += away
            self._last_step_time = now

    def checkpointed(self, start: float) -> dict[str, Any]:
        """A checkpoint began at ``start`` at the current step: what the snapshot event says about
        the window it closes (interval, clean iterations, other work); the next window starts."""
        window = {
            "interval_steps": self.step - self.last_checkpoint,
            "interval_s": start - self.last_checkpoint_time,
            "clean_iterations": self.clean_count,
            "clean_iteration_s": self.clean_seconds / self.clean_count if self.clean_count else None,
            "away_s": self.away_seconds,
        }
        self.last_checkpoint, self.last_checkpoint_time = self.step, start
        self.clean_count, self.clean_seconds, self.away_seconds = 0, 0.0, 0.0
        return window

    def context(
        self, now: float, profiler: Profiler, *, persist_in_flight: bool, epoch: int | None, loss: float | None
    ) -> DecisionContext:
        """What a policy decides from at the current step."""
        changed = self._last_epoch is not None and epoch != self._last_epoch
        self._last_epoch = epoch
        return DecisionContext(
            step=self.step,
            session_steps=self.step - self.session_start,
            steps_since_checkpoint=self.step - self.last_checkpoint,
            elapsed=now - self.started,
            seconds_since_checkpoint=now - self.last_checkpoint_time,
            iteration_time=profiler.iteration.value,
            iteration_time_while_persisting=profiler.iteration_while_persisting.value,
            stall=profiler.stall.value,
            persist_time=profiler.persist.value,
            checkpoint_cost=profiler.checkpoint_cost.value,
            away=profiler.away,
            away_since_checkpoint=self.away_seconds,
            bytes_per_checkpoint=profiler.bytes_per_checkpoint,
            persist_in_flight=persist_in_flight,
            epoch=epoch,
            epoch_changed=changed,
            loss=loss,
        )
