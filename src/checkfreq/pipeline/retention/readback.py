"""Checkpoints read back before they hold a slot of ``keep``: retention deletes a valid checkpoint
only in favour of checkpoints it has read back whole, so damage nothing has read yet never takes a
valid checkpoint's place.

A checkpoint is read back through the store's verified readers (``read_manifest``, ``read_data``:
the ones the restore and ``checkfreq verify`` read through), at most once per process: what this
directory holds of it, so that each directory's leader reads its own files. One found damaged is
set aside as the restore sets it aside (:meth:`~checkfreq.storage.Store.set_aside`), out of the
listing, so that it holds no slot.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from enum import Enum
from typing import Any

from checkfreq.errors import CorruptCheckpointError
from checkfreq.storage.base import Store
from checkfreq.storage.format import Manifest, data_file_name

log = logging.getLogger("checkfreq.retention")


class Sifted(Enum):
    """What reading back the checkpoints that hold a slot found."""

    SOUND = "sound"
    """Every one read back whole: what they displace may go."""
    DAMAGED = "damaged"
    """Some were damaged and are set aside: the listing changed, so retention decides again."""
    UNREAD = "unread"
    """Some could not be read now, or stay listed though damaged: nothing is deleted this time."""


class ReadBack:
    """The checkpoints of one store read back whole, each once (by step; a checkpoint committed again
    at its step is read again when the retainer says it is new).

    Args:
        store: the directory (or object store) retention applies to.
        directory: the directory leader this process is (the lowest rank whose directory it is): of a
            checkpoint of several ranks it reads the files of the ranks that share its directory, as
            the manifest records them. None: every file.
    """

    def __init__(self, store: Store, directory: int | None = None) -> None:
        self.store, self.directory = store, directory
        self._sound: set[int] = set()
        self._damaged: set[int] = set()
        self.bytes_read = 0
        """Bytes read back so far (data files, as their manifests list them)."""

    def sift(self, holders: Mapping[int, Any], fresh: Collection[int] = ()) -> Sifted:
        """Read back each checkpoint of ``holders`` (step → location) not read yet, newest first, and set
        aside the damaged ones. ``fresh``: steps committed again since they were read."""
        self._sound.difference_update(fresh)
        self._damaged.difference_update(fresh)
        outcome = Sifted.SOUND
        for step, location in sorted(holders.items(), key=lambda held: -held[0]):
            if step in self._sound:
                continue
            if step in self._damaged:  # set aside before, yet listed still: a store that cannot change
                outcome = Sifted.UNREAD
                continue
            try:
                self.bytes_read += self._read(location)
            except CorruptCheckpointError as e:
                self._damaged.add(step)
                self.store.set_aside(location, f"read back before retention counted it: {e}")
                outcome = Sifted.DAMAGED if outcome is Sifted.SOUND else outcome
            except OSError as e:  # a passing error says nothing of the checkpoint: read it again next time
                log.warning(
                    "step %d of %s could not be read back (%s): no checkpoint is deleted in its favour this time",
                    step,
                    self.store.root,
                    e,
                )
                outcome = Sifted.UNREAD
            else:
                self._sound.add(step)
        return outcome

    def _read(self, location: Any) -> int:
        """Read one checkpoint back through the store's verified readers; return the bytes read."""
        manifest = self.store.read_manifest(location)
        read = 0
        for name in self._own_files(manifest):
            entry = manifest.files[name]
            self.store.read_data(location, name, entry["size"], entry["xxh3_64"])
            read += entry["size"]
        return read

    def _own_files(self, manifest: Manifest) -> list[str]:
        """The data files of ``manifest`` this directory holds: every one, but for a checkpoint of
        node-local directories, those of the ranks whose directory is this one."""
        directories = (manifest.distributed or {}).get("directories")
        if self.directory is None or not isinstance(directories, list) or len(directories) != manifest.world_size:
            return list(manifest.files)
        own = {data_file_name(rank) for rank, leader in enumerate(directories) if leader == self.directory}
        return [name for name in manifest.files if name in own]
