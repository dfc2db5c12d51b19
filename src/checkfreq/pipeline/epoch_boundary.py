"""A checkpoint due at an epoch's last batch is taken at the epoch boundary instead.

The loop's ``ckpt.step()`` after an epoch's last optimizer step comes before the work the loop does
after the inner loop (an epoch-level scheduler, an evaluation, a best score), while the loader's
state already says "next epoch, nothing taken": a checkpoint taken then would resume past that work
without holding it. So what ``step()`` decided there (the policy's checkpoint, the tiers' own
snapshots) waits for the boundary: the loop asking the loader for its next pass (the next epoch,
a peek) or moving it to an epoch, or ``save()``/``close()``. No optimizer step happens in
between, so the step label is the same; a kill before the boundary falls back to the previous
checkpoint, as any kill between checkpoints does. A ``step()`` that comes first (a loop that never
iterates the loader again) takes it at its own step instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from checkfreq.data.loader import ResumableLoader
from checkfreq.pipeline.tier import Tier


@dataclass(frozen=True)
class Deferred:
    """What ``step()`` decided at an epoch's last batch (the boundary also acts on a trapped signal)."""

    step: int
    checkpoint: bool
    """The policy's checkpoint (else only ``tiers``' own snapshots)."""
    tiers: tuple[Tier, ...]


class BoundaryListener:
    """What a :class:`ResumableLoader` tells (a new pass, the next batch), passed on to ``owner``'s
    ``_at_boundary``/``_before_batch`` while it lives (the loader keeps no Checkpointer alive)."""

    def __init__(self, owner: Any) -> None:
        self._owner = weakref.ref(owner)

    def before_new_pass(self) -> None:
        owner = self._owner()
        if owner is not None:
            owner._at_boundary()

    def before_batch(self) -> None:
        owner = self._owner()
        if owner is not None:
            owner._before_batch()


class EpochBoundary:
    """Watches the registered :class:`ResumableLoader` s for an epoch's last batch and holds what was deferred.

    Args:
        objects: the registered objects (the loaders among them are watched).
        listener: told of each loader's new passes and batches.
    """

    def __init__(self, objects: Iterable[Any], listener: BoundaryListener) -> None:
        self._loaders = [o for o in objects if isinstance(o, ResumableLoader)]
        self._removers: list[Callable[[], None]] = [loader.add_listener(listener) for loader in self._loaders]
        self.deferred: Deferred | None = None

    @property
    def at_last_batch(self) -> bool:
        """Whether a watched loader's last batch handed out is its epoch's last, its pass not yet over."""
        return any(loader.last_of_epoch for loader in self._loaders)

    def defer(self, step: int, checkpoint: bool, tiers: Iterable[Tier]) -> None:
        """Keep what ``step()`` decided for the boundary (also nothing: a trapped signal is acted on there)."""
        self.deferred = Deferred(step, checkpoint, tuple(tiers))

    def take(self) -> Deferred | None:
        """What waits for the boundary, once."""
        deferred, self.deferred = self.deferred, None
        return deferred

    def close(self) -> None:
        """Stop listening to the loaders."""
        for remove in self._removers:
            remove()
        self._removers = []
        self.deferred = None


__all__ = ["BoundaryListener", "Deferred", "EpochBoundary"]
