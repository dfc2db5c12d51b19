"""Checkpoints in any fsspec filesystem: object stores (``s3://``, ``gs://``), ``memory://``, ...

Object stores have no atomic rename, so a checkpoint is written in place, at its final name
``<root>/step_000001200/``: the data files first, then ``manifest.json``. The manifest is the
commit marker: a checkpoint is listed only once its manifest exists, and a reader verifies every
data file against the manifest's sizes and checksums. A writer killed mid-upload leaves a
directory without a manifest, which readers never list and the next writer removes.
Deleting works the other way round: the manifest goes first, so a checkpoint half-deleted is
already invisible.

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

from checkfreq.errors import CheckpointNotFoundError, CorruptCheckpointError, DirectoryNotWritableError
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
        committed = {location for _, location in self.checkpoints()}
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
        """Checkpoints whose manifest exists, as (step, location), newest first."""
        self.fs.invalidate_cache()  # another process may have written since we last looked
        manifests = self.fs.glob(str(self._base / "step_*" / MANIFEST_NAME))
        found = []
        for manifest in manifests:
            location = PurePosixPath(manifest).parent
            step = checkpoint_step(location.name)
            if step is not None and location.parent == self._base:
                found.append((step, self._base / location.name))
        return sorted(found, reverse=True)

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
        return Manifest.from_json(raw)

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
