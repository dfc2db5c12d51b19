"""The remote tier: each committed checkpoint copied to durable storage in the background.

Every rank copies its own data file of a checkpoint from its local directory (node-local disks
included) to the remote store; once every rank has reported its copy verified, rank 0 writes the
remote ``manifest.json`` last, so a checkpoint whose upload never finished on some rank is never
listed there. Uploads run in a thread of their own, one at a time, on a gloo group of their own.

Every rank uploads the same checkpoints: the commit protocol hands a checkpoint over only if every
rank's uploader was idle when it reported (:class:`~checkfreq.pipeline.save.commit.CommitResult`), so a slow
remote skips checkpoints rather than queueing them; :meth:`RemoteTier.flush` uploads the newest
committed one if it was skipped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from checkfreq.errors import CorruptCheckpointError, PersistError, PersistTimeoutError
from checkfreq.pipeline.retention.best import ScoreBook
from checkfreq.pipeline.retention.retainer import Retainer, retain
from checkfreq.pipeline.tiers.roles import CheckpointSource, CommitFollower, TierName
from checkfreq.policies.retention import Retention
from checkfreq.ranks.collectives import (
    JSON,
    Peers,
    RankError,
    broadcast_message,
    collect_errors,
    during,
    gather_messages,
)
from checkfreq.storage.base import Store
from checkfreq.storage.format import CHUNK_BYTES, MANIFEST_NAME, Manifest, data_file_name
from checkfreq.storage.local import LocalStore
from checkfreq.storage.posix import read_manifest_bytes

log = logging.getLogger("checkfreq.upload")


@dataclass(frozen=True)
class UploadOutcome:
    """0 → every rank, once every rank's copy is verified: whether rank 0 committed the remote
    checkpoint, or why not."""

    ok: bool = True
    error: str | None = None

    def to_wire(self) -> JSON:
        return {"ok": True} if self.ok else {"ok": False, "error": self.error}

    @classmethod
    def from_wire(cls, wire: JSON) -> UploadOutcome:
        return cls(True) if wire["ok"] else cls(False, wire["error"])


class RemoteTier(CommitFollower, CheckpointSource):
    """This rank's part in copying checkpoints from its local directory to the remote store, and
    the remote store as the restore reads it.

    Args:
        local: the local tier, where checkpoints are committed first.
        remote: the durable tier.
        peers: the ranks uploading together (their upload group).
        token: names this job's staging locations in ``remote``.
        retention: what the remote tier keeps (applied by rank 0).
        local_retainer: the local tier's retention, told which checkpoint is being read.
    """

    def __init__(
        self,
        local: LocalStore,
        remote: Store,
        peers: Peers,
        *,
        token: str,
        retention: Retention,
        local_retainer: Retainer,
    ) -> None:
        self.local, self.remote, self.peers, self.token = local, remote, peers, token
        self._retention = retention
        self._scores = ScoreBook(remote)  # what retention of the remote tier read of its checkpoints' scores
        self._local_retainer = local_retainer
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.uploaded: int | None = None
        self._uploaded_manifest = ""
        """The digest of the manifest copied last (a checkpoint taken again at a step has another)."""
        """The newest step this job copied (the same on every rank)."""

    name = TierName.REMOTE

    @property
    def store(self) -> Store:
        """The remote store, as the restore reads it."""
        return self.remote

    @property
    def ready(self) -> bool:
        """No upload in flight."""
        return self._thread is None or not self._thread.is_alive()

    def follow(self, step: int, source: Store) -> None:
        """Copy checkpoint ``step`` of the local directory (``source``) in the background (every rank
        follows the same steps)."""
        if not self.ready:
            raise RuntimeError("an upload is already running")
        self._local_retainer.uploading = step
        self._thread = threading.Thread(target=self._run, args=(step,), name="checkfreq-uploader", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Block until the upload in flight is done (its error stays for :meth:`take_error`)."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise PersistTimeoutError(f"upload to {self.remote.root} still running after {timeout} s")

    def flush(self, newest: int | None, timeout: float | None = None) -> None:
        """Wait for the upload in flight, then copy ``newest`` (the newest committed step) if it was
        skipped; raise a failed upload's error. Collective: every rank calls it with the same step."""
        self.stop(timeout)
        self._raise()
        if newest is not None and (self.uploaded is None or newest > self.uploaded or self._replaced(newest)):
            self._local_retainer.uploading = newest
            self._run(newest)
            self._raise()

    def _replaced(self, step: int) -> bool:
        """Whether local checkpoint ``step`` was taken again (``save()`` at the same step) since it was copied."""
        try:
            return _digest((self.local.location(step) / MANIFEST_NAME).read_bytes()) != self._uploaded_manifest
        except OSError:
            return False

    def take_error(self) -> BaseException | None:
        error, self._error = self._error, None
        return error

    def describe_error(self, error: BaseException) -> str:
        return f"copying a checkpoint to {self.remote.root} failed: {error}"

    def close(self, *, remove: bool, timeout: float | None = None) -> None:
        """Nothing to stop: the upload in flight was waited for (:meth:`flush`, :meth:`stop`)."""

    def release(self) -> None:
        self.remote.unlock()

    def _raise(self) -> None:
        error = self.take_error()
        if error is not None:
            raise PersistError(f"copying a checkpoint to {self.remote.root} failed: {error}") from error

    def _run(self, step: int) -> None:
        try:
            start = time.perf_counter()
            with during(self.peers, f"the upload of step {step} to the remote tier"):
                self._upload(step)
            self.uploaded = step
            log.info("copied step %d to %s in %.2f s", step, self.remote.root, time.perf_counter() - start)
        except BaseException as e:  # noqa: BLE001 - reported to the training thread
            log.error("copying step %d to %s failed: %s", step, self.remote.root, e)
            self._error = e
        finally:
            self._local_retainer.uploading = None
            self._local_retainer.run()

    @property
    def tends_listing(self) -> bool:
        """Rank 0 of the upload group changes what the remote tier lists (it commits and applies retention there)."""
        return self.peers.rank == 0

    def _upload(self, step: int) -> None:
        rank = self.peers.rank
        error: str | None = None
        if rank == 0:
            try:
                self.remote.staging_dir(step, self.token)
            except Exception as e:  # noqa: BLE001 - every rank hears it
                error = f"rank 0: {type(e).__name__}: {e}"
        _raise_failures(collect_errors(self.peers, error), step)
        staging = self.remote.staging_dir(step, self.token, create=False)
        source = self.local.location(step)
        error = None
        try:
            manifest_bytes = read_manifest_bytes(source)
            manifest = Manifest.from_json(manifest_bytes, step=step)
            name = data_file_name(rank)
            self._copy(source / name, staging, name, manifest.files[name]["xxh3_64"])
        except Exception as e:  # noqa: BLE001 - every rank hears it
            error = f"rank {rank}: {type(e).__name__}: {e}"
        errors = gather_messages(self.peers, RankError(error), RankError.from_wire)  # on rank 0 only
        outcome: UploadOutcome | None = None
        if errors is not None:
            outcome = UploadOutcome()
            try:
                _raise_failures([e.error for e in errors if e.error], step)
                self.remote.write_file(staging, MANIFEST_NAME, [manifest_bytes])
                self.remote.commit(staging, step)
                retain(self.remote, self._retention, {step}, self._scores)
            except Exception as e:  # noqa: BLE001 - every rank hears it
                self.remote.discard(staging)
                outcome = UploadOutcome(False, str(e))
        outcome = broadcast_message(self.peers, outcome, UploadOutcome.from_wire)
        if not outcome.ok:
            raise PersistError(outcome.error)
        self._uploaded_manifest = _digest(manifest_bytes)

    def _copy(self, path: Path, staging: Any, name: str, checksum: str) -> None:
        """Stream one local file to ``staging``, verifying it against the manifest as it goes."""
        hasher = xxhash.xxh3_64()
        with open(path, "rb") as f:
            self.remote.write_file(staging, name, _hashed_chunks(f, hasher))
        if hasher.hexdigest() != checksum:
            raise CorruptCheckpointError(f"{path} changed or is damaged; not uploaded")


def _digest(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def _raise_failures(failed: list[str], step: int) -> None:
    if failed:
        raise PersistError(f"step {step} not copied: {'; '.join(failed)}")


def _hashed_chunks(f: BinaryIO, hasher: Any) -> Iterator[bytes]:
    while chunk := f.read(CHUNK_BYTES):
        hasher.update(chunk)
        yield chunk
