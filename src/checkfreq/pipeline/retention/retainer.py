"""Retention applied: the leader of a directory deletes the checkpoints its rule dooms, and the
damaged checkpoints set aside there once they have expired. For a rule that keeps the best, each
checkpoint's score is read from its manifest (:class:`~checkfreq.pipeline.retention.best.ScoreBook`).
Before a checkpoint is deleted, the ones that hold a slot in its place are read back
(:class:`~checkfreq.pipeline.retention.readback.ReadBack`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from typing import Any

from checkfreq.pipeline.retention.best import ScoreBook
from checkfreq.pipeline.retention.readback import ReadBack, Sifted
from checkfreq.policies.retention import Retention
from checkfreq.storage.base import Store

log = logging.getLogger("checkfreq.retention")


def sift(
    store: Store,
    retention: Retention,
    protect: Collection[int] = (),
    book: ScoreBook | None = None,
    readback: ReadBack | None = None,
    fresh: Collection[int] = (),
) -> tuple[dict[int, Any], list[int]]:
    """What ``store`` lists and what ``retention`` dooms of it (never one in ``protect``), deleting
    nothing. With ``readback``, the checkpoints that hold a slot are read back first: the damaged ones
    are set aside and retention decides again; while one could not be read, nothing is doomed.
    ``fresh``: the steps committed again since they were read."""
    while True:  # each round sets aside at least one more checkpoint, or is the last
        listed = dict(store.checkpoints())
        scores, unreadable = None, set[int]()
        if retention.best is not None:
            scores, unreadable = (book or ScoreBook(store)).scores(listed, retention.metric, fresh=fresh)
        doomed = retention.doomed(listed, set(protect) | unreadable, scores)
        if not doomed or readback is None:
            return listed, doomed
        sifted = readback.sift({step: listed[step] for step in retention.holders(listed, scores)}, fresh)
        fresh = ()
        if sifted is not Sifted.DAMAGED:
            return listed, (doomed if sifted is Sifted.SOUND else [])


def retain(
    store: Store,
    retention: Retention,
    protect: Collection[int] = (),
    book: ScoreBook | None = None,
    readback: ReadBack | None = None,
    fresh: Collection[int] | None = None,
) -> None:
    """Delete the checkpoints of ``store`` that ``retention`` dooms (never one in ``protect``), then
    the set-aside damaged ones it says have expired. Only the checkpoints ``store`` lists count: a
    damaged checkpoint set aside never holds a slot of ``keep``. ``book`` keeps the scores read;
    ``readback``, when given, reads back the checkpoints that hold a slot first (:func:`sift`).
    ``fresh``: the steps committed since they were read (default ``protect``)."""
    listed, doomed = sift(store, retention, protect, book, readback, protect if fresh is None else fresh)
    for step in doomed:
        store.delete(listed[step])
    aside = store.set_aside_checkpoints()
    if aside:
        expired = set(retention.expired((s for s in listed if s not in doomed), (a.step for a in aside)))
        for checkpoint in aside:
            if checkpoint.step in expired:
                log.info(
                    "deleting %s of %s, set aside as %s (%s): %d newer checkpoints are valid",
                    checkpoint.name,
                    store.root,
                    checkpoint.kind.value,
                    checkpoint.reason,
                    retention.keep,
                )
                store.delete(checkpoint.location)


class Retainer:
    """Applies a directory's :class:`Retention` (:func:`retain`), on the directory's leader only, each
    checkpoint that holds a slot read back once first (``directory``: the leader's rank, whose
    directory's files it reads; :class:`ReadBack`).

    Called by the writer after a commit and by the uploader after an upload; never deletes the
    checkpoint an upload is reading.
    """

    def __init__(self, store: Store, retention: Retention, *, leader: bool, directory: int | None = None) -> None:
        self.store, self.retention, self.leader = store, retention, leader
        self.book = ScoreBook(store)
        self.readback = ReadBack(store, directory)
        self._lock = threading.Lock()
        self.uploading: int | None = None

    def check(self, protect: int | None = None, damaged: Collection[int] = (), *, fresh: bool = True) -> list[int]:
        """Read back the checkpoints that hold a slot, deleting nothing, and set aside the damaged ones
        and those of ``damaged`` this directory lists (found damaged in another directory of the job:
        without that directory's files they cannot restore either); the steps set aside here now.
        ``protect``: the checkpoint just committed (``fresh``: read again if it was taken before)."""
        if not self.leader:
            return []
        with self._lock:
            listed = dict(self.store.checkpoints())
            for step in sorted(set(damaged) & set(listed), reverse=True):
                self.store.set_aside(listed[step], "found damaged in another directory of the job when read back")
            kept = {s for s in (protect, self.uploading) if s is not None}
            committed = {protect} if fresh and protect is not None else set()
            sift(self.store, self.retention, kept, self.book, self.readback, committed)
            listed_now = {step for step, _ in self.store.checkpoints()}
            return sorted(step for step in listed if step not in listed_now and step not in damaged)

    def run(self, protect: int | None = None) -> None:
        """Apply retention (after :meth:`check` where a commit just happened); ``protect``: the
        checkpoint just committed."""
        if not self.leader:
            return
        with self._lock:
            kept = {s for s in (protect, self.uploading) if s is not None}
            retain(self.store, self.retention, kept, self.book, self.readback, fresh=())
