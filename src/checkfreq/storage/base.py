"""The narrow interface every checkpoint store implements, and the helpers that write through it.

The engine (``Checkpointer``) talks to storage only through :class:`Store`: it asks for a
staging location, streams files into it (data files first, ``manifest.json`` last), commits it,
lists committed checkpoints, reads them back and deletes them (:mod:`checkfreq.policies.retention`
says which). How a commit is made atomic is the store's business: a local directory renames a
fully fsynced staging directory; an object store has no atomic rename, so the manifest, written
last, is the commit marker and a checkpoint without one is never listed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import xxhash

from checkfreq.storage.format import MANIFEST_NAME, Manifest, data_chunks


class Location(Protocol):
    """Where one checkpoint lives in a store (a ``PurePath`` for the stores here)."""

    @property
    def name(self) -> str:
        """The checkpoint's directory name, ``step_NNNNNNNNN``."""
        ...


class Store(Protocol):
    """Where checkpoints live: staging, atomic commit, listing, reading, deleting.

    Locations are opaque to callers: a location returned by a store is only ever handed back
    to the same store.
    """

    root: Any
    """The store's address for messages: a ``Path`` for a local directory, else a URL."""

    @property
    def events_directory(self) -> Path:
        """A local directory for the run's event log."""
        ...

    def check_writable(self) -> None:
        """Fail now, with a clear message, if checkpoints could not be written later."""

    def lock(self) -> None:
        """Claim the store for this writer where the store can (a local directory can)."""

    def unlock(self) -> None:
        """Release what :meth:`lock` took and finish background work (may raise its error)."""

    def remove_staging(self) -> None:
        """Delete leftovers of writes that never committed (only while holding the store)."""

    def staging_dir(self, step: int, token: str, *, create: bool = True) -> Any:
        """The location the job named ``token`` writes checkpoint ``step`` into; ``create`` prepares
        it (called once, by one rank, before any rank writes there)."""

    def location(self, step: int) -> Location:
        """Where committed checkpoint ``step`` lives (whether or not it exists)."""
        ...

    def file_size(self, location: Any, name: str) -> int | None:
        """The size of one file of a checkpoint, or None if it is missing."""

    def write_file(self, staging: Any, name: str, chunks: Iterable[bytes | memoryview]) -> None:
        """Write one file from ``chunks`` into ``staging``; it is durable when this returns."""

    def commit(self, staging: Any, step: int) -> Location:
        """Publish a fully written staging location (its manifest written last) as ``step``."""
        ...

    def discard(self, staging: Any) -> None:
        """Remove a staging location that will never be committed."""

    def checkpoints(self) -> Sequence[tuple[int, Location]]:
        """Committed checkpoints as (step, location), newest first."""
        ...

    def read_manifest(self, location: Any) -> Manifest:
        """Read and validate a checkpoint's manifest (:class:`CorruptCheckpointError` if bad)."""
        ...

    def read_data(self, location: Any, name: str, size: int, checksum: str) -> tuple[torch.Tensor, dict[str, Any]]:
        """Read and verify one data file: its data section (flat ``uint8``) and parsed header."""
        ...

    def delete(self, location: Any) -> None:
        """Remove a committed checkpoint so that a kill never leaves half of it listed."""


def write_data(store: Store, staging: Any, name: str, header: bytes, data: torch.Tensor) -> tuple[int, str]:
    """Stream a data file (``header`` + the flat buffer ``data``) into ``store``; return (size, xxh3-64)."""
    hasher = xxhash.xxh3_64()
    store.write_file(staging, name, data_chunks(header, data, hasher))
    return len(header) + data.numel(), hasher.hexdigest()


def write_manifest(store: Store, staging: Any, manifest: Manifest) -> None:
    """Write ``manifest.json`` into ``staging``: the last file of a checkpoint, its commit record."""
    store.write_file(staging, MANIFEST_NAME, [manifest.to_json()])

