"""Retention applied: the leader of a directory deletes the checkpoints its rule dooms."""

from __future__ import annotations

import threading

from checkfreq.policies.retention import Retention
from checkfreq.storage.base import Store


class Retainer:
    """Deletes a directory's checkpoints that its :class:`Retention` dooms, on the directory's leader only.

    Called by the writer after a commit and by the uploader after an upload; never deletes the
    checkpoint an upload is reading.
    """

    def __init__(self, store: Store, retention: Retention, *, leader: bool) -> None:
        self.store, self.retention, self.leader = store, retention, leader
        self._lock = threading.Lock()
        self.uploading: int | None = None

    def run(self, protect: int | None = None) -> None:
        if not self.leader:
            return
        with self._lock:
            listed = dict(self.store.checkpoints())
            keep = {s for s in (protect, self.uploading) if s is not None}
            for step in self.retention.doomed(listed, keep):
                self.store.delete(listed[step])
