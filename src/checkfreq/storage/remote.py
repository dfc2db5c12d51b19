"""Checkpoints in any fsspec filesystem: object stores (``s3://``, ``gs://``), ``memory://``, ...

Object stores have no atomic rename, so a checkpoint is written in place, at its final name
``<root>/step_000001200/``: the data files first, then ``manifest.json``. The manifest is the
commit marker: a checkpoint is listed only once its manifest exists, and a reader verifies every
data file against the manifest's sizes and checksums. A writer killed mid-upload leaves a
directory without a manifest, which readers never list and the next writer removes.
Deleting works the other way round: the manifest goes first, so a checkpoint half-deleted is
already invisible.

Objects cannot be renamed (a copy of every byte), so a checkpoint found damaged is set aside in
place: a marker, ``damaged.json``, written into it (one atomic put) takes it out of the listing.
The marker records the xxh3-64 of the manifest the checkpoint had, and hides it only while that
manifest is there: a checkpoint written again at the same step (which first deletes the old one,
marker included) is never hidden by a marker left over from a race. Deleting the marker undoes it.

Object stores offer no lock that a dead process releases: give each run its own prefix.
"""

from __future__ import annotations

import logging
import tempfile
import uuid
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

import torch
import xxhash

from checkfreq.errors import CheckpointNotFoundError, CorruptCheckpointError, DirectoryNotWritableError
from checkfreq.storage.base import (
    DAMAGED_NAME,
    MAX_MARKER_BYTES,
    Aside,
    SetAside,
    damaged_marker,
    read_marker,
    set_aside_of,
)
from checkfreq.storage.format import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, checkpoint_name, checkpoint_step
from checkfreq.storage.posix import read_data_stream

log = logging.getLogger("checkfreq.storage")


class FsspecStore:
    """A checkpoint directory in an fsspec filesystem, committed by writing the manifest last.

    Args:
        url: where checkpoints go, e.g. ``"s3://bucket/runs/exp1"`` or ``"memory://exp1"``.
        create: create the directory (an object store bucket, if missing) now.
        **storage_options: passed to the filesystem, e.g. ``endpoint_url``, ``key``,
            ``secret`` for s3fs or ``token`` for gcsfs.
    """

    def __init__(self, url: str, *, create: bool = True, **storage_options: Any) -> None:
        import fsspec

        self.fs, path = fsspec.core.url_to_fs(url, **storage_options)
        self.root = url
        self._base = PurePosixPath(path.rstrip("/"))
        self._events: Path | None = None
        if create:
            self.fs.makedirs(str(self._base), exist_ok=True)
        elif not self.fs.exists(str(self._base)):
            raise CheckpointNotFoundError(f"checkpoint directory {url} does not exist")

    def __repr__(self) -> str:
        return f"FsspecStore({self.root!r})"

    @property
    def events_directory(self) -> Path:
        """A local temporary directory: object stores cannot append to a log."""
        if self._events is None:
            self._events = Path(tempfile.mkdtemp(prefix="checkfreq-events-"))
            log.info("the event log of %s is kept locally in %s", self.root, self._events)
        return self._events

    def check_writable(self) -> None:
        probe = str(self._base / f".probe-{uuid.uuid4().hex}")
        try:
            self.fs.pipe_file(probe, b"")
            self.fs.rm_file(probe)
        except OSError as e:
            raise DirectoryNotWritableError(f"checkpoint directory {self.root} is not writable: {e}") from None

    def lock(self) -> None:
        log.debug("%s: object stores have no lock; one writer per directory is up to the user", self.root)

    def unlock(self) -> None:
        """Nothing to release (see :meth:`lock`)."""

    def remove_staging(self) -> None:
        committed = set(self._scan()[0].values())  # those set aside too: they are committed
        for location in self._step_dirs().values():
            if location not in committed:
                log.info("removing uncommitted checkpoint %s/%s", self.root, location.name)
                self._remove(location)

    def staging_dir(self, step: int, token: str, *, create: bool = True) -> PurePosixPath:
        """The checkpoint's final location (objects cannot be renamed; ``token`` is not needed);
        ``create`` first deletes a checkpoint already there."""
        location = self.location(step)
        if create:
            if self.fs.exists(str(location)):
                self._remove(location)
            if self.fs.exists(str(self._base)):  # never re-create a bucket deleted under a running job
                self.fs.makedirs(str(location), exist_ok=True)
        return location

    def location(self, step: int) -> PurePosixPath:
        return self._base / checkpoint_name(step)

    def file_size(self, location: PurePosixPath, name: str) -> int | None:
        try:
            return int(self.fs.size(str(location / name)))
        except (FileNotFoundError, OSError):
            return None

    def write_file(self, staging: PurePosixPath, name: str, chunks: Iterable[bytes | memoryview]) -> None:
        f = self.fs.open(str(staging / name), "wb")
        try:
            for chunk in chunks:
                f.write(chunk)
        except BaseException:
            if hasattr(f, "discard"):  # abort a multipart upload instead of completing it
                f.discard()
            raise
        f.close()

    def commit(self, staging: PurePosixPath, step: int) -> PurePosixPath:
        """Nothing left to do: the manifest, already written last, is the commit marker."""
        self.fs.invalidate_cache()
        return staging

    def discard(self, staging: PurePosixPath) -> None:
        self._remove(staging)

    def checkpoints(self) -> list[tuple[int, PurePosixPath]]:
        """Checkpoints whose manifest exists and that are not set aside, as (step, location), newest first."""
        committed, marked = self._scan()
        hidden = {step for step in marked if step in committed and self._marker(committed[step]) is not None}
        return sorted(((step, location) for step, location in committed.items() if step not in hidden), reverse=True)

    def set_aside(self, location: PurePosixPath, reason: str, kind: Aside = Aside.DAMAGED) -> PurePosixPath | None:
        """Write ``damaged.json`` into the checkpoint ``location`` (damaged, or of an abandoned course:
        ``kind``), which hides it while its
        manifest is the one there now; None where it is left in place (no manifest any more, or the
        store refuses the write)."""
        manifest = str(location / MANIFEST_NAME)
        try:
            raw = self.fs.cat_file(manifest) if self.fs.size(manifest) <= MAX_MANIFEST_BYTES else None
        except FileNotFoundError:
            return None  # no longer committed: nothing lists it
        except OSError:
            raw = None  # unreadable: the marker hides whatever manifest is there
        digest = None if raw is None else xxhash.xxh3_64_hexdigest(raw)
        try:
            self.fs.pipe_file(str(location / DAMAGED_NAME), damaged_marker(reason, digest, kind))
        except OSError as e:
            log.warning(
                "checkpoint %s of %s %s but cannot be set aside (%s): left in place",
                location.name,
                self.root,
                kind.describe(reason),
                e,
            )
            return None
        finally:
            self.fs.invalidate_cache()
        log.log(
            kind.level,
            "checkpoint %s of %s %s: set aside (%s written into it); it is no longer "
            "listed, restored or counted by keep=",
            location.name,
            self.root,
            kind.describe(reason),
            DAMAGED_NAME,
        )
        return location

    def set_aside_checkpoints(self) -> list[SetAside]:
        """The committed checkpoints whose marker hides them, newest first."""
        committed, marked = self._scan()
        found = []
        for step in sorted(marked, reverse=True):
            record = self._marker(committed[step]) if step in committed else None
            if record is not None:
                found.append(set_aside_of(step, committed[step], record))
        return found

    def _scan(self) -> tuple[dict[int, PurePosixPath], dict[int, PurePosixPath]]:
        """The ``step_*`` locations holding a manifest, and those holding a ``damaged.json``."""
        self.fs.invalidate_cache()  # another process may have written since we last looked
        committed: dict[int, PurePosixPath] = {}
        marked: dict[int, PurePosixPath] = {}
        for path in self.fs.glob(str(self._base / "step_*" / "*.json")):
            location = PurePosixPath(path).parent
            step = checkpoint_step(location.name)
            if step is None or location.parent != self._base:
                continue
            if PurePosixPath(path).name == MANIFEST_NAME:
                committed[step] = self._base / location.name
            elif PurePosixPath(path).name == DAMAGED_NAME:
                marked[step] = self._base / location.name
        return committed, marked

    def _marker(self, location: PurePosixPath) -> dict[str, Any] | None:
        """The record of ``location``'s marker if it hides the checkpoint (it names the manifest there
        now, or none), else None."""
        try:
            raw = self.fs.cat_file(str(location / DAMAGED_NAME), start=0, end=MAX_MARKER_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError:
            raw = None
        record = read_marker(raw)
        digest = record.get("manifest_xxh3")
        if not isinstance(digest, str):
            return record
        try:
            manifest = self.fs.cat_file(str(location / MANIFEST_NAME), start=0, end=MAX_MANIFEST_BYTES + 1)
        except OSError:
            return record  # FileNotFoundError included: no manifest, nothing to list anyway
        return record if xxhash.xxh3_64_hexdigest(manifest) == digest else None

    def read_manifest(self, location: PurePosixPath) -> Manifest:
        path = str(location / MANIFEST_NAME)
        try:
            if self.fs.size(path) > MAX_MANIFEST_BYTES:
                raise CorruptCheckpointError("manifest is implausibly large")
            raw = self.fs.cat_file(path)
        except FileNotFoundError:
            raise CorruptCheckpointError("manifest.json is missing (checkpoint never committed)") from None
        except OSError as e:
            raise CorruptCheckpointError(f"{MANIFEST_NAME} cannot be read: {e}") from None
        return Manifest.from_json(raw, step=checkpoint_step(location.name))

    def read_data(
        self, location: PurePosixPath, name: str, size: int, checksum: str
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        path = str(location / name)
        try:
            actual = self.fs.size(path)
            f = self.fs.open(path, "rb", cache_type="none")
        except FileNotFoundError:
            raise CorruptCheckpointError(f"data file {name} is missing") from None
        except OSError as e:
            raise CorruptCheckpointError(f"data file {name} cannot be opened: {e}") from None
        return read_data_stream(f, name, actual, size, checksum)

    def delete(self, location: PurePosixPath) -> None:
        self._remove(location)

    def _step_dirs(self) -> dict[int, PurePosixPath]:
        """Every ``step_*`` directory, committed or not."""
        try:
            entries = self.fs.ls(str(self._base), detail=False)
        except FileNotFoundError:
            return {}
        found = {}
        for entry in entries:
            step = checkpoint_step(PurePosixPath(entry).name)
            if step is not None:
                found[step] = self._base / PurePosixPath(entry).name
        return found

    def _remove(self, location: PurePosixPath) -> None:
        """Delete the manifest first (the checkpoint vanishes at once), then everything else."""
        for path, recursive in ((str(location / MANIFEST_NAME), False), (str(location), True)):
            try:
                self.fs.rm(path, recursive=recursive)
            except FileNotFoundError:
                pass
        self.fs.invalidate_cache()
