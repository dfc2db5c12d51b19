"""Which committed checkpoints to delete: a pure policy over step numbers.

A store lists its checkpoints; :class:`Retention` says which of them go. It keeps the newest
``keep`` checkpoints and, with ``every``, each checkpoint whose step is a multiple of ``every``
(milestones for later evaluation or for going back past a divergence). It never dooms a
protected checkpoint (the one just committed, one still being uploaded) nor the newest one.

It counts only the checkpoints a store lists, and a store never lists a checkpoint found damaged
(:meth:`checkfreq.storage.Store.set_aside`): so ``keep=n`` keeps n checkpoints that restore, as far as
anything has read them, and a damaged checkpoint never holds a slot a valid one needed. Damaged
checkpoints are kept apart, for inspection, until ``keep`` valid ones are newer
(:meth:`Retention.expired`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from checkfreq.errors import InvalidArgumentError


@dataclass(frozen=True)
class Retention:
    """Keep the newest ``keep`` checkpoints, plus every checkpoint whose step is a multiple of ``every``."""

    keep: int
    every: int | None = None

    def __post_init__(self) -> None:
        for name, value in (("keep", self.keep), ("every", self.every)):
            if value is None and name == "every":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"Retention: {name} must be an int >= 1, got {value!r}")

    @classmethod
    def of(cls, keep: int | Retention) -> Retention:
        """``keep`` as a Checkpointer option takes it: a count of checkpoints, or a Retention."""
        return keep if isinstance(keep, Retention) else cls(keep)

    def doomed(self, steps: Iterable[int], protect: Collection[int] = ()) -> list[int]:
        """The steps to delete, oldest first: never one in ``protect``, never the newest.

        ``steps`` are the checkpoints a store lists, which are the valid ones: a checkpoint found
        damaged is set aside, out of the listing, and counts toward nothing here."""
        newest_first = sorted(set(steps), reverse=True)
        kept = set(newest_first[: self.keep]).union(protect)
        if self.every is not None:
            kept.update(step for step in newest_first if step % self.every == 0)
        return sorted(step for step in newest_first if step not in kept)

    def expired(self, valid: Iterable[int], damaged: Iterable[int]) -> list[int]:
        """The damaged (set-aside) steps to delete, oldest first: those that ``keep`` of the ``valid``
        steps are newer than. A damaged checkpoint never holds a slot, and nothing valid ever goes in
        its favour; it stays, for inspection, no longer than a valid checkpoint of its step would
        have (milestones, ``every``, keep only valid checkpoints)."""
        kept = sorted(set(valid), reverse=True)[: self.keep]
        if len(kept) < self.keep:
            return []
        return sorted(step for step in set(damaged) if step < kept[-1])
