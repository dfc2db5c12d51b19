"""Which committed checkpoints to delete: a small pure policy shared by every tier."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Retention:
    """Keep the newest ``keep`` checkpoints, and every checkpoint whose step is a multiple of ``every``."""

    keep: int
    every: int | None = None

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise ValueError(f"keep must be at least 1, got {self.keep}")
        if self.every is not None and self.every < 1:
            raise ValueError(f"keep_every must be at least 1, got {self.every}")

    def doomed(self, steps: Iterable[int], protect: Collection[int] = ()) -> list[int]:
        """The steps to delete, newest first: never the newest ``keep``, a kept multiple, or a protected step."""
        ordered = sorted(set(steps), reverse=True)
        return [
            step for step in ordered[self.keep :]
            if step not in protect and not (self.every is not None and step % self.every == 0)
        ]
