"""Which committed checkpoints to delete: a pure policy over step numbers.

A store lists its checkpoints; :class:`Retention` says which of them go. It keeps the newest
``keep`` checkpoints and, with ``every``, each checkpoint whose step is a multiple of ``every``
(milestones for later evaluation or for going back past a divergence) and, with ``best``, the
``top`` checkpoints that score best by a metric (their scores are given: the retainer reads each
checkpoint's from its manifest). It never dooms a protected checkpoint (the one just committed, one
still being uploaded) nor the newest one.

A checkpoint without a score (none was logged at its step; docs/storage.md, "Keeping the best")
is never among the best: it is kept only as one of the newest or as a milestone. A score that is
not a number (NaN) counts as none. Of equal scores the older checkpoint ranks first, so a newer one
must score strictly better to displace it.

It counts only the checkpoints a store lists, and a store never lists a checkpoint found damaged
(:meth:`checkfreq.storage.Store.set_aside`). The checkpoints that hold a slot (:meth:`Retention.holders`)
are read back before anything is deleted in their favour (:mod:`checkfreq.pipeline.retention.readback`),
so ``keep=n`` keeps n checkpoints that restore and a damaged checkpoint never holds a slot a valid one
needed. Damaged checkpoints are kept apart, for inspection, until ``keep`` valid ones are newer
(:meth:`Retention.expired`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from checkfreq.errors import InvalidArgumentError


@dataclass(frozen=True)
class Retention:
    """Keep the newest ``keep`` checkpoints, plus every checkpoint whose step is a multiple of ``every``,
    plus (with ``best=(metric, "min" | "max")``) the ``top`` checkpoints that score best by ``metric``.

    ``Retention(3, best=("val_loss", "min"), top=2)`` keeps the newest three to resume from and
    the two with the lowest ``val_loss`` logged at their step, however old (docs/storage.md).
    """

    keep: int
    every: int | None = None
    best: tuple[str, str] | None = None
    """The metric and ``"min"`` (lower is better) or ``"max"``."""
    top: int = 1
    """How many of the best to keep (with ``best``)."""

    def __post_init__(self) -> None:
        for name, value in (("keep", self.keep), ("every", self.every), ("top", self.top)):
            if value is None and name == "every":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"Retention: {name} must be an int >= 1, got {value!r}")
        best = self.best
        if best is None:
            if self.top != 1:
                raise InvalidArgumentError(f"Retention: top={self.top} needs best=(metric, 'min' or 'max')")
            return
        if not (
            isinstance(best, (tuple, list))
            and len(best) == 2
            and isinstance(best[0], str)
            and best[0]
            and best[1] in ("min", "max")
        ):
            raise InvalidArgumentError(
                f"Retention: best must be (metric name, 'min' or 'max'), e.g. ('val_loss', 'min'); got {best!r}"
            )
        object.__setattr__(self, "best", (best[0], best[1]))

    @property
    def metric(self) -> str | None:
        """The metric the best are chosen by, if any."""
        return None if self.best is None else self.best[0]

    @classmethod
    def of(cls, keep: int | Retention) -> Retention:
        """``keep`` as a Checkpointer option takes it: a count of checkpoints, or a Retention."""
        return keep if isinstance(keep, Retention) else cls(keep)

    def doomed(
        self, steps: Iterable[int], protect: Collection[int] = (), scores: Mapping[int, float | None] | None = None
    ) -> list[int]:
        """The steps to delete, oldest first: never one in ``protect``, never the newest, never one of
        the ``top`` best by ``scores`` (step → its score; a step absent or None has none).

        ``steps`` are the checkpoints a store lists, which are the valid ones: a checkpoint found
        damaged is set aside, out of the listing, and counts toward nothing here."""
        newest_first = sorted(set(steps), reverse=True)
        kept = set(newest_first[: self.keep]).union(protect)
        if self.every is not None:
            kept.update(step for step in newest_first if step % self.every == 0)
        kept.update(self.best_steps(newest_first, scores or {}))
        return sorted(step for step in newest_first if step not in kept)

    def holders(self, steps: Iterable[int], scores: Mapping[int, float | None] | None = None) -> list[int]:
        """The steps that hold a slot, newest first: the newest ``keep`` and the ``top`` best by ``scores``.
        A checkpoint is deleted only in their favour (milestones and protected checkpoints hold no slot:
        they are kept whatever the others are), so these are the ones to have read back first."""
        newest_first = sorted(set(steps), reverse=True)
        held = set(newest_first[: self.keep]).union(self.best_steps(newest_first, scores or {}))
        return sorted(held, reverse=True)

    def best_steps(self, steps: Iterable[int], scores: Mapping[int, float | None]) -> list[int]:
        """The ``top`` steps of ``steps`` that score best, best first (ties: the older first); [] without ``best``."""
        if self.best is None:
            return []
        sign = 1.0 if self.best[1] == "min" else -1.0
        scored = [
            (sign * value, step)
            for step in set(steps)
            if (value := scores.get(step)) is not None and not math.isnan(value)
        ]
        return [step for _, step in sorted(scored)[: self.top]]

    def expired(self, valid: Iterable[int], damaged: Iterable[int]) -> list[int]:
        """The damaged (set-aside) steps to delete, oldest first: those that ``keep`` of the ``valid``
        steps are newer than. A damaged checkpoint never holds a slot, and nothing valid ever goes in
        its favour; it stays, for inspection, no longer than a valid checkpoint of its step would
        have (milestones, ``every``, keep only valid checkpoints)."""
        kept = sorted(set(valid), reverse=True)[: self.keep]
        if len(kept) < self.keep:
            return []
        return sorted(step for step in set(damaged) if step < kept[-1])
