"""The narrow interface every checkpoint store implements, and the helpers that write through it.

The engine (``Checkpointer``) talks to storage only through :class:`Store`: it asks for a
staging location, streams files into it (data files first, ``manifest.json`` last), commits it,
lists committed checkpoints, reads them back and deletes them (:mod:`checkfreq.policies.retention`
says which). How a commit is made atomic is the store's business: a local directory renames a
fully fsynced staging directory; an object store has no atomic rename, so the manifest, written
last, is the commit marker and a checkpoint without one is never listed.

A checkpoint found damaged (a restore skipped it, ``checkfreq verify`` failed it) is *set aside*
(:meth:`Store.set_aside`): taken out of :meth:`Store.checkpoints`, so that it is never restored and
never holds a retention slot, but not deleted, so that it stays for inspection and a damage that was
not real (a read that failed for a passing reason) can be undone by hand. A local directory renames
it to ``step_N.damaged-<id>/``; an object store, which cannot rename, writes a marker file
(:data:`DAMAGED_NAME`) into it. Either way the marker records why; retention deletes a set-aside
checkpoint once ``keep`` newer valid ones exist (:meth:`checkfreq.policies.retention.Retention.expired`).

A checkpoint of a course the run left is set aside the same way (:attr:`Aside.ABANDONED`): a run
that goes on from an older step (``restore(step=N)``, ``restore("best")``) sets aside the newer
ones, which a later restore must never take (``step_N.abandoned-<id>/`` in a local directory).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

import torch
import xxhash

from checkfreq.storage.format import MANIFEST_NAME, Manifest, data_chunks

DAMAGED_NAME = "damaged.json"
"""The marker of a checkpoint set aside as damaged: why, when, by which process."""
MAX_MARKER_BYTES = 64 << 10


class Aside(str, Enum):
    """Why a checkpoint is set aside."""

    DAMAGED = "damaged"
    """Found damaged: a read failed its checks."""
    ABANDONED = "abandoned"
    """Sound, but newer than the step the run went on from: of a course the run left."""

    @property
    def level(self) -> int:
        """The level of its log line: damage is a warning; a course left is said once by whoever left it."""
        return logging.WARNING if self is Aside.DAMAGED else logging.INFO

    def describe(self, reason: str) -> str:
        """What a log line says of a checkpoint set aside for ``reason``."""
        return f"is damaged ({reason})" if self is Aside.DAMAGED else f"is of a course the run left ({reason})"


class Location(Protocol):
    """Where one checkpoint lives in a store (a ``PurePath`` for the stores here)."""

    @property
    def name(self) -> str:
        """The checkpoint's directory name, ``step_NNNNNNNNN``."""
        ...


@dataclass(frozen=True)
class SetAside:
    """A checkpoint set aside (damaged, or of an abandoned course): never listed, restored or counted by retention."""

    step: int
    location: Any
    """Where it is now (a location of the store that set it aside)."""
    reason: str
    """Why it was found damaged (as its marker records it)."""
    when: float | None
    """When it was set aside (seconds since the epoch); None if its marker is unreadable."""
    kind: Aside = Aside.DAMAGED
    """Why: damaged, or of a course the run left."""

    @property
    def name(self) -> str:
        """Its name now: ``step_N.damaged-<id>`` (``.abandoned-<id>``) in a local directory, ``step_N``
        in an object store."""
        return str(self.location.name)


def damaged_marker(reason: str, manifest_digest: str | None = None, kind: Aside = Aside.DAMAGED) -> bytes:
    """The contents of :data:`DAMAGED_NAME`: why, when and by whom a checkpoint was set aside, and
    the xxh3-64 of the manifest it was found with (an object store hides the checkpoint only while
    that manifest is there, so a checkpoint written again at the same step is not hidden)."""
    record = {
        "kind": kind.value,
        "reason": reason,
        "set_aside": time.time(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "manifest_xxh3": manifest_digest,
    }
    return json.dumps(record, indent=1).encode()


def read_marker(raw: bytes | None) -> dict[str, Any]:
    """A marker's record; an unreadable or malformed one reads as ``{}`` (the reason unknown)."""
    try:
        record = json.loads(raw or b"") if raw is not None and len(raw) <= MAX_MARKER_BYTES else {}
    except ValueError:
        record = {}
    return record if isinstance(record, dict) else {}


def set_aside_of(step: int, location: Any, record: dict[str, Any]) -> SetAside:
    """A :class:`SetAside` from its marker's record (:func:`read_marker`)."""
    reason, when = record.get("reason"), record.get("set_aside")
    return SetAside(
        step,
        location,
        reason if isinstance(reason, str) else "reason not recorded",
        float(when) if isinstance(when, (int, float)) and not isinstance(when, bool) else None,
        Aside.ABANDONED if record.get("kind") == Aside.ABANDONED.value else Aside.DAMAGED,
    )


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
        """Remove a committed (or set-aside) checkpoint so that a kill never leaves half of it listed."""

    def set_aside(self, location: Any, reason: str, kind: Aside = Aside.DAMAGED) -> Any | None:
        """Take the checkpoint at ``location`` (one :meth:`checkpoints` listed), damaged or of an
        abandoned course (``kind``), out of the listing, keeping its files, with a marker saying
        ``reason``; log it once. Return where it is now, or None where it is left in place (gone
        already, or the store is read-only). Never raises for a store it cannot change."""

    def set_aside_checkpoints(self) -> Sequence[SetAside]:
        """The checkpoints set aside, newest first."""
        ...


def write_data(store: Store, staging: Any, name: str, header: bytes, data: torch.Tensor) -> tuple[int, str]:
    """Stream a data file (``header`` + the flat buffer ``data``) into ``store``; return (size, xxh3-64)."""
    hasher = xxhash.xxh3_64()
    store.write_file(staging, name, data_chunks(header, data, hasher))
    return len(header) + data.numel(), hasher.hexdigest()


def write_manifest(store: Store, staging: Any, manifest: Manifest) -> None:
    """Write ``manifest.json`` into ``staging``: the last file of a checkpoint, its commit record."""
    store.write_file(staging, MANIFEST_NAME, [manifest.to_json()])
