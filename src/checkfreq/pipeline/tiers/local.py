"""The local tier: the Checkpointer's own directory."""

from __future__ import annotations

from checkfreq.pipeline.tiers.roles import CheckpointSource, TierName
from checkfreq.storage.base import Store


class LocalTier(CheckpointSource):
    """The Checkpointer's directory: what every persist commits to (the commit protocol writes it),
    and the first place the restore looks for files."""

    name = TierName.LOCAL

    def __init__(self, store: Store, *, leader: bool = True) -> None:
        self._store, self._leader = store, leader

    @property
    def store(self) -> Store:
        return self._store

    @property
    def tends_listing(self) -> bool:
        """The directory's leader (one rank per directory) changes what it lists."""
        return self._leader

    def close(self, *, remove: bool, timeout: float | None = None) -> None:
        """Nothing runs in the background: the commit protocol writes the directory."""

    def release(self) -> None:
        self._store.unlock()
