"""The best checkpoints of a run, from a shell: ``checkfreq ls`` marks them, ``checkfreq export --best``
exports the best one.

Each checkpoint's manifest records its score (:mod:`checkfreq.pipeline.retention.best`), and with it the rule of
the run that wrote it (the metric, ``"min"`` or ``"max"``, how many of the best it keeps): the best are
ranked by the rule of the newest scored checkpoint, as that run's retention ranks them.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from checkfreq.errors import CorruptCheckpointError, NoValidCheckpointError
from checkfreq.pipeline.retention.best import Score, ranked, score_of
from checkfreq.storage import Store, open_store
from checkfreq.tools.catalog import CheckpointRef


@dataclass(frozen=True)
class BestMark:
    """One of a run's best checkpoints: its rank (1: the best) by ``metric`` and its value."""

    metric: str
    mode: str
    value: float
    rank: int
    top: int
    """How many of the best the run keeps."""

    def to_dict(self) -> dict[str, object]:
        record = asdict(self)
        del record["top"]
        return record


@dataclass(frozen=True)
class Ranking:
    """The scores of a run's listed checkpoints and its best ones."""

    scores: dict[int, float | None]
    """step → its value of the ranking metric (None: no score)."""
    best: dict[int, BestMark]
    """step → its mark, for the best ``top`` of them."""
    refs: dict[int, CheckpointRef]


def rank_run(root: str | os.PathLike[str] | Store) -> Ranking:
    """The scores and the best checkpoints of the run at ``root`` (a path, a URL or a store)."""
    store = root if not isinstance(root, (str, os.PathLike)) else open_store(root, create=False)
    scored: list[tuple[int, Score | None]] = []
    refs = {}
    for step, location in store.checkpoints():
        refs[step] = CheckpointRef(store, location)
        try:
            scored.append((step, score_of(refs[step].read_manifest())))
        except (CorruptCheckpointError, OSError):  # a damaged manifest: no score (ls says why)
            scored.append((step, None))
    rule, best = ranked(scored, None)
    if rule is None or rule.best is None:
        return Ranking({}, {}, refs)
    scores = {step: (s.value if s is not None and s.metric == rule.metric else None) for step, s in scored}
    marks = {}
    for rank, step in enumerate(best, 1):
        value = scores[step]
        assert value is not None  # ranked only what has a value
        marks[step] = BestMark(rule.best[0], rule.best[1], value, rank, rule.top)
    return Ranking(scores, marks, refs)


def best_checkpoint(root: str | os.PathLike[str]) -> CheckpointRef:
    """The best-scored checkpoint of the run at ``root``; :class:`NoValidCheckpointError` if none has a score."""
    ranking = rank_run(root)
    if not ranking.best:
        raise NoValidCheckpointError(
            f"{root}: none of its {len(ranking.refs)} checkpoints has a score: a run keeps the best with "
            "keep=Retention(n, best=(metric, 'min' or 'max')) and ckpt.log(metric=value) (docs/storage.md, "
            '"Keeping the best"); name a checkpoint instead (RUN/step_N, as checkfreq ls lists them)'
        )
    step = min(ranking.best, key=lambda s: ranking.best[s].rank)
    return ranking.refs[step]


__all__ = ["BestMark", "Ranking", "best_checkpoint", "rank_run"]
