"""Two tiers: commit to a fast local directory, copy to a remote store in the background.

The training loop only ever waits for the local commit (the stall users feel). Each committed
checkpoint is then copied, by one uploader thread, to the remote store, where its manifest is
written last. At most one upload runs; if checkpoints are committed faster than they upload,
only the newest one waits its turn (the older one waiting is skipped, with a log line). Local
retention never deletes a checkpoint that is waiting for or in upload.

Restore lists both tiers and takes the newest valid checkpoint of either (local first at equal
steps), so a run resumes from its local directory after a crash, and from the remote store on a
fresh machine. A failed upload is reported at the next commit (like any persist error) and at
``close()``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, BinaryIO

import torch
import xxhash

from checkfreq.errors import CorruptCheckpointError, PersistError
from checkfreq.format import CHUNK_BYTES, MANIFEST_NAME, Manifest
from checkfreq.retention import Retention
from checkfreq.storage.base import Store
from checkfreq.storage.local import LocalStore

log = logging.getLogger("checkfreq.storage")


@dataclass(frozen=True)
class TierLocation:
    """A checkpoint in one tier of a :class:`TieredStore`."""

    tier: str
    """``"local"`` or ``"remote"``."""
    path: Any
    """The location inside that tier's store."""

    @property
    def name(self) -> str:
        return PurePath(str(self.path)).name

    def __str__(self) -> str:
        return f"{self.path} ({self.tier})"


class TieredStore:
    """A local :class:`~checkfreq.storage.local.LocalStore` in front of a remote :class:`Store`.

    Args:
        local: the fast tier: every checkpoint is committed here first.
        remote: the durable tier each checkpoint is copied to in the background.
        remote_keep: how many checkpoints to keep in ``remote`` (``keep`` applies to ``local``).
        timeout: seconds :meth:`unlock` waits for the upload in flight before raising ``TimeoutError``.
    """

    def __init__(self, local: LocalStore, remote: Store, *, remote_keep: int, timeout: float = 3600.0) -> None:
        if remote_keep < 1:
            raise ValueError(f"remote_keep must be at least 1, got {remote_keep}")
        self.local, self.remote = local, remote
        self.root = local.root
        self._remote_keep = remote_keep
        self._cond = threading.Condition()
        self._waiting: tuple[int, Path] | None = None
        self._uploading: Path | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._keep: Retention | None = None
        self._timeout = timeout  # the longest unlock() waits for an upload: a hung remote never hangs close()

    @property
    def events_directory(self) -> Path:
        return self.local.root

    def check_writable(self) -> None:
        self.local.check_writable()
        self.remote.check_writable()

    def lock(self) -> None:
        self.local.lock()
        self.remote.lock()

    def unlock(self) -> None:
        """Finish the uploads (raising a failure), stop the uploader and release both tiers."""
        try:
            self.flush(self._timeout)
        finally:
            self._stop()
            try:
                self.remote.unlock()
            finally:
                self.local.unlock()

    def remove_staging(self) -> None:
        self.local.remove_staging()
        self.remote.remove_staging()

    def staging_dir(self, step: int) -> Path:
        return self.local.staging_dir(step)

    def write_file(self, staging: Path, name: str, chunks: Iterable[bytes | memoryview]) -> None:
        self.local.write_file(staging, name, chunks)

    def commit(self, staging: Path, step: int) -> TierLocation:
        """Commit locally, queue the upload, and report a failed earlier upload."""
        final = self.local.commit(staging, step)
        self._queue(step, final)
        self._raise_failure()
        return TierLocation("local", final)

    def discard(self, staging: Path) -> None:
        self.local.discard(staging)

    def checkpoints(self) -> list[tuple[int, TierLocation]]:
        """Committed checkpoints of both tiers, newest first, the local one first at equal steps."""
        local = [(step, 0, TierLocation("local", p)) for step, p in self.local.checkpoints()]
        remote = [(step, 1, TierLocation("remote", p)) for step, p in self.remote.checkpoints()]
        merged = sorted(local + remote, key=lambda item: (-item[0], item[1]))
        return [(step, location) for step, _, location in merged]

    def read_manifest(self, location: TierLocation) -> Manifest:
        return self._tier(location).read_manifest(location.path)

    def read_data(self, location: TierLocation, name: str, size: int, checksum: str) -> tuple[torch.Tensor, dict[str, Any]]:
        return self._tier(location).read_data(location.path, name, size, checksum)

    def retain(self, retention: Retention, protect: TierLocation) -> None:
        """Local retention (again after each upload); the remote tier keeps ``remote_keep``."""
        with self._cond:
            self._keep = retention
            self._retain_local(protect.path)

    def _retain_local(self, protect: Path | None) -> None:
        """Delete the local checkpoints retention dooms, except ``protect`` and those queued or in upload."""
        if self._keep is None:
            return
        busy = {protect, self._uploading, self._waiting[1] if self._waiting else None}
        for path in self._keep.doomed_locations(self.local.checkpoints(), busy):
            self.local.delete(path)

    def delete(self, location: TierLocation) -> None:
        self._tier(location).delete(location.path)

    def flush(self, timeout: float | None = None) -> None:
        """Block until every queued upload is done; raise :class:`PersistError` if one failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._waiting is not None or self._uploading is not None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"upload to {self.remote.root} still running after {timeout} s")
                self._cond.wait(remaining)
        self._raise_failure()

    # ------------------------------------------------------------------ uploader

    def _tier(self, location: TierLocation) -> Store:
        return self.local if location.tier == "local" else self.remote

    def _queue(self, step: int, path: Path) -> None:
        with self._cond:
            if self._waiting is not None:
                log.info("upload of step %d skipped: step %d supersedes it", self._waiting[0], step)
            self._waiting = (step, path)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="checkfreq-uploader", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(self._timeout)

    def _raise_failure(self) -> None:
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise PersistError(f"copying a checkpoint to {self.remote.root} failed: {error}") from error

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None and not self._stopping:
                    self._cond.wait()
                if self._waiting is None:
                    return
                (step, path), self._waiting = self._waiting, None
                self._uploading = path
            try:
                self._upload(step, path)
            except BaseException as e:  # noqa: BLE001 - reported to the training thread
                log.error("upload of step %d to %s failed: %s", step, self.remote.root, e)
                with self._cond:
                    self._error = e
            finally:
                with self._cond:
                    self._uploading = None
                    self._retain_local(None)
                    self._cond.notify_all()

    def _upload(self, step: int, path: Path) -> None:
        """Copy one committed local checkpoint: data files (verified as they stream), manifest last."""
        start = time.perf_counter()
        raw = (path / MANIFEST_NAME).read_bytes()
        manifest = Manifest.from_json(raw)
        staging = self.remote.staging_dir(step)
        try:
            for name, entry in manifest.files.items():
                hasher = xxhash.xxh3_64()
                with open(path / name, "rb") as f:
                    self.remote.write_file(staging, name, _hashed_chunks(f, hasher))
                if hasher.hexdigest() != entry["xxh3_64"]:
                    raise CorruptCheckpointError(f"{path / name} changed or is damaged; not uploaded")
            self.remote.write_file(staging, MANIFEST_NAME, [raw])
            final = self.remote.commit(staging, step)
        except BaseException:
            self.remote.discard(staging)
            raise
        self.remote.retain(Retention(self._remote_keep), final)
        log.info("copied %s to %s in %.2f s", path.name, self.remote.root, time.perf_counter() - start)


def _hashed_chunks(f: BinaryIO, hasher: Any) -> Iterator[bytes]:
    while chunk := f.read(CHUNK_BYTES):
        hasher.update(chunk)
        yield chunk
