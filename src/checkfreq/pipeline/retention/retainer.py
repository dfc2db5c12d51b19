"""Retention applied: the leader of a directory deletes the checkpoints its rule dooms, and the
damaged checkpoints set aside there once they have expired. For a rule that keeps the best, each
checkpoint's score is read from its manifest (:class:`~checkfreq.pipeline.retention.best.ScoreBook`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection

from checkfreq.pipeline.retention.best import ScoreBook
from checkfreq.policies.retention import Retention
from checkfreq.storage.base import Store

log = logging.getLogger("checkfreq.retention")


def retain(store: Store, retention: Retention, protect: Collection[int] = (), book: ScoreBook | None = None) -> None:
    """Delete the checkpoints of ``store`` that ``retention`` dooms (never one in ``protect``), then
    the set-aside damaged ones it says have expired. Only the checkpoints ``store`` lists count: a
    damaged checkpoint set aside never holds a slot of ``keep``. ``book`` keeps the scores read
    (``protect`` holds the checkpoints committed since, whose scores are read again)."""
    listed = dict(store.checkpoints())
    scores, unreadable = None, set[int]()
    if retention.best is not None:
        scores, unreadable = (book or ScoreBook(store)).scores(listed, retention.metric, fresh=protect)
    doomed = retention.doomed(listed, set(protect) | unreadable, scores)
    for step in doomed:
        store.delete(listed[step])
    aside = store.set_aside_checkpoints()
    if aside:
        expired = set(retention.expired((s for s in listed if s not in doomed), (a.step for a in aside)))
        for checkpoint in aside:
            if checkpoint.step in expired:
                log.info(
                    "deleting %s of %s, set aside as damaged (%s): %d newer checkpoints are valid",
                    checkpoint.name,
                    store.root,
                    checkpoint.reason,
                    retention.keep,
                )
                store.delete(checkpoint.location)


class Retainer:
    """Applies a directory's :class:`Retention` (:func:`retain`), on the directory's leader only.

    Called by the writer after a commit and by the uploader after an upload; never deletes the
    checkpoint an upload is reading.
    """

    def __init__(self, store: Store, retention: Retention, *, leader: bool) -> None:
        self.store, self.retention, self.leader = store, retention, leader
        self.book = ScoreBook(store)
        self._lock = threading.Lock()
        self.uploading: int | None = None

    def run(self, protect: int | None = None) -> None:
        if not self.leader:
            return
        with self._lock:
            retain(self.store, self.retention, {s for s in (protect, self.uploading) if s is not None}, self.book)
