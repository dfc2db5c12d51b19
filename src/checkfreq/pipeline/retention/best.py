"""Keeping the best checkpoints: each checkpoint's score, read back from its manifest.

A capture takes its score (:mod:`checkfreq.run.scores`) into the ``checkfreq`` entry of its state;
the commit writes rank 0's into the manifest (:attr:`~checkfreq.storage.format.Manifest.score`):
``{"metric", "mode", "top", "value"}``. So the score of every checkpoint a store lists is durable
with it, and a run resumed after a kill ranks the old checkpoints as the run that wrote them did.

:class:`ScoreBook` reads the scores for the retainer (each manifest once); :func:`best_step` picks
the checkpoint ``restore(step="best")`` restores, the same one on every rank (rank 0's
:class:`BestChoice`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from checkfreq.errors import CorruptCheckpointError, NoValidCheckpointError
from checkfreq.pipeline.capture.registered import RUN_STATE
from checkfreq.policies.retention import Retention
from checkfreq.ranks.collectives import JSON, Peers, broadcast_message
from checkfreq.run.scores import SCORE_KEY
from checkfreq.storage.base import Store
from checkfreq.storage.format import Manifest

log = logging.getLogger("checkfreq.retention")


class Listing(Protocol):
    """What lists checkpoints and reads their manifests: a store, or a tier of the restore."""

    def checkpoints(self) -> Sequence[tuple[int, Any]]: ...

    def read_manifest(self, location: Any) -> Manifest: ...


@dataclass(frozen=True)
class Score:
    """A checkpoint's score, as its manifest records it."""

    metric: str
    mode: str
    """``"min"`` or ``"max"``."""
    top: int
    """How many of the best the run that wrote it kept."""
    value: float | None
    """None: the metric had no value at the checkpoint's step."""


@dataclass(frozen=True)
class BestChoice:
    """0 → every rank, at ``restore(step="best")``: the best-scored checkpoint the stores list (None:
    none is scored), and whether they list any checkpoint. On the wire: ``[step, listed]``."""

    step: int | None
    listed: bool

    def to_wire(self) -> JSON:
        return [self.step, self.listed]

    @classmethod
    def from_wire(cls, wire: JSON) -> BestChoice:
        step, listed = wire
        return cls(None if step is None else int(step), bool(listed))


def score_of(manifest: Manifest) -> Score | None:
    """The score ``manifest`` records, or None (none recorded, or not in the form a score takes)."""
    raw = manifest.score
    if not isinstance(raw, dict):
        return None
    metric, mode, top, value = raw.get("metric"), raw.get("mode"), raw.get("top"), raw.get("value")
    if not isinstance(metric, str) or mode not in ("min", "max") or isinstance(top, bool) or not isinstance(top, int):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        value = None
    return Score(metric, mode, max(top, 1), None if value is None else float(value))


def score_entry(skeleton: Any) -> dict[str, Any] | None:
    """The score a capture took into its skeleton's ``checkfreq`` entry (what the manifest records)."""
    run = skeleton.get(RUN_STATE) if isinstance(skeleton, dict) else None
    entry = run.get(SCORE_KEY) if isinstance(run, dict) else None
    return entry if isinstance(entry, dict) else None


class ScoreBook:
    """The scores of one store's checkpoints for one metric, each manifest read once (by step; a
    checkpoint taken again at its step is read again when the retainer says it is new)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._read: dict[int, Score | None] = {}

    def scores(
        self, listed: Mapping[int, Any], metric: str | None, fresh: Collection[int] = ()
    ) -> tuple[dict[int, float | None], set[int]]:
        """Each listed step's value of ``metric`` (None: no score for it), and the steps whose manifest
        could not be read now (the retainer keeps them this time: a passing read error must not cost a
        best checkpoint). ``fresh``: steps committed again since they were read."""
        for step in fresh:
            self._read.pop(step, None)
        for step in [s for s in self._read if s not in listed]:
            del self._read[step]
        unreadable: set[int] = set()
        for step, location in listed.items():
            if step in self._read:
                continue
            try:
                self._read[step] = score_of(self.store.read_manifest(location))
            except (CorruptCheckpointError, OSError) as e:
                log.debug("no score for step %d of %s: %s", step, self.store.root, e)
                unreadable.add(step)
        values = {step: (s.value if s is not None and s.metric == metric else None) for step, s in self._read.items()}
        return values, unreadable


def ranked(
    scores: Iterable[tuple[int, Score | None]], retention: Retention | None
) -> tuple[Retention | None, list[int]]:
    """The retention that ranks ``scores`` (step, score), newest first: ``retention`` if it keeps a
    best, else the one the newest scored checkpoint was written with; and its best steps, best first."""
    scores = list(scores)
    if retention is None or retention.best is None:
        recorded = next((s for _, s in scores if s is not None), None)
        if recorded is None:
            return None, []
        retention = Retention(1, best=(recorded.metric, recorded.mode), top=recorded.top)
    values = {step: (s.value if s is not None and s.metric == retention.metric else None) for step, s in scores}
    return retention, retention.best_steps(values, values)


def best_step(stores: Iterable[Listing], peers: Peers, retention: Retention) -> int | None:
    """The step ``restore(step="best")`` restores: the best-scored checkpoint the ``stores`` list (by
    ``retention``'s metric, or, without one, the metric the checkpoints record), rank 0's choice on
    every rank (collective). None when no store lists a checkpoint; :class:`NoValidCheckpointError`
    when some are listed but none has a score."""
    listed: dict[int, Score | None] = {}
    for store in stores:
        for step, location in store.checkpoints():
            if listed.get(step) is None:
                try:
                    listed[step] = score_of(store.read_manifest(location))
                except (CorruptCheckpointError, OSError):
                    listed.setdefault(step, None)
    ranking, best = ranked(sorted(listed.items(), reverse=True), retention)
    mine = BestChoice(best[0] if best else None, bool(listed)) if peers.rank == 0 else None
    chosen = broadcast_message(peers, mine, BestChoice.from_wire)
    if chosen.step is not None or not chosen.listed:
        return chosen.step
    what = f"a value of {ranking.metric!r}" if ranking is not None else "a score (no Retention(best=...) wrote them)"
    raise NoValidCheckpointError(
        f"restore(step='best'): none of the {len(listed)} checkpoints listed has {what}. A checkpoint is scored by "
        'the metric logged at its own step (ckpt.log(val_loss=...), docs/storage.md, "Keeping the best"); '
        "restore(step=N) picks one by its step (checkfreq ls lists them)"
    )


__all__ = ["BestChoice", "Score", "ScoreBook", "best_step", "ranked", "score_entry", "score_of"]
