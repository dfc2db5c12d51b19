"""Where checkpoints live: a local directory with atomic commits, listing, retention and a lock.

Layout: ``<root>/step_000001200/`` (committed), ``<root>/step_000001200.tmp-<id>/`` (being written;
never read) and ``<root>/step_000001200.damaged-<id>/`` (set aside as damaged, with a
``damaged.json`` saying why; never listed; ``.abandoned-<id>``: of a course the run left). A
checkpoint becomes visible only through the final ``rename``, after every file and the manifest are
fsynced; the parent directory is fsynced after the rename. Setting aside is one ``rename`` too: a
kill leaves the checkpoint either listed or set aside.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from checkfreq.errors import (
    CheckpointDirectoryError,
    CheckpointNotFoundError,
    DirectoryLockedError,
    DirectoryNotWritableError,
)
from checkfreq.storage.base import (
    DAMAGED_NAME,
    MAX_MARKER_BYTES,
    Aside,
    SetAside,
    damaged_marker,
    read_marker,
    set_aside_of,
)
from checkfreq.storage.format import Manifest, checkpoint_name, checkpoint_step
from checkfreq.storage.posix import read_data_file, read_manifest, write_chunks

log = logging.getLogger("checkfreq.storage.local")

LOCK_NAME = ".checkfreq.lock"
_SET_ASIDE_NAME = re.compile(r"^step_(\d{9,})\.(?:damaged|abandoned)-[0-9a-f]{12}$")
_HELD_LOCKS: set[int] = set()


def _locked_message(root: Path, pid: str) -> str:
    """One line on a directory whose lock another writer holds: which directory, which process
    (its command line where this machine can see it), and what to do."""
    where = f"checkpoint directory {root.resolve()} is locked by another checkfreq writer"
    if pid == str(os.getpid()):
        return (
            f"{where} in this process (pid {pid}): close() the Checkpointer open on it first, or use another directory"
        )
    try:
        command = " ".join(
            Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split()
        )
    except (OSError, ValueError):
        command = ""  # not on this machine (a shared filesystem), or no /proc
    holder = f"pid {pid or 'unknown'}" + (
        f": {command[:77]}..." if len(command) > 80 else f": {command}" if command else ""
    )
    return f"{where} ({holder}); wait for it to end or stop it, or give this job a directory of its own"


def _drop_inherited_locks() -> None:
    """In a forked child: close the inherited lock descriptors (the lock stays the parent's)."""
    for fd in _HELD_LOCKS:
        os.close(fd)
    _HELD_LOCKS.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore:
    """A checkpoint directory on a local (or POSIX network) filesystem."""

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True) -> None:
        self.root = Path(root)
        if create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise CheckpointDirectoryError(
                    e.errno, f"cannot create checkpoint directory {self.root}: {e.strerror}"
                ) from None
        if self.root.exists() and not self.root.is_dir():
            raise CheckpointNotFoundError(
                f"{self.root} is a file, not a checkpoint directory: give the run directory, the one that holds "
                "the step_* checkpoints"
            )
        if not self.root.is_dir():
            raise CheckpointNotFoundError(f"checkpoint directory {self.root} does not exist")
        self._lock_fd: int | None = None

    def check_writable(self) -> None:
        """Fail now, with a clear message, if checkpoints could not be written here later."""
        probe = self.root / f".probe-{uuid.uuid4().hex}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise DirectoryNotWritableError(f"checkpoint directory {self.root} is not writable: {e.strerror}") from None

    def lock(self) -> None:
        """Take the directory's writer lock (released by the OS if this process dies).

        Forked children (DataLoader workers) close their copy of the lock's descriptor, so
        orphaned workers of a killed job never keep its restart locked out.
        """
        fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DirectoryLockedError(
                    _locked_message(self.root, (self.root / LOCK_NAME).read_text().strip())
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd
        _HELD_LOCKS.add(fd)

    def unlock(self) -> None:
        if self._lock_fd is not None:
            _HELD_LOCKS.discard(self._lock_fd)
            os.close(self._lock_fd)
            self._lock_fd = None

    def remove_staging(self) -> None:
        """Delete leftovers of writes that never committed (only safe while holding the lock)."""
        for path in self.root.glob("step_*.tmp-*"):
            log.info("removing uncommitted checkpoint %s", path.name)
            if path.is_symlink():  # the link only, never what it points to
                path.unlink(missing_ok=True)
            else:
                shutil.rmtree(path, ignore_errors=True)

    def staging_dir(self, step: int, token: str, *, create: bool = True) -> Path:
        """Where checkpoint ``step`` of the job named ``token`` is written (every rank sharing
        this directory writes its file there); ``create`` makes it."""
        path = self.root / f"{checkpoint_name(step)}.tmp-{token}"
        if create:
            path.mkdir(exist_ok=True)
        return path

    def location(self, step: int) -> Path:
        """Where committed checkpoint ``step`` lives."""
        return self.root / checkpoint_name(step)

    def file_size(self, location: Path, name: str) -> int | None:
        """The size of one file of a checkpoint, or None if it is missing."""
        try:
            return (location / name).stat().st_size
        except OSError:
            return None

    @property
    def events_directory(self) -> Path:
        """The run's event log lives next to its checkpoints."""
        return self.root

    def write_file(self, staging: Path, name: str, chunks: Iterable[bytes | memoryview]) -> None:
        """Write ``staging/name`` straight from ``chunks`` (no copy; direct I/O where aligned) and fsync it.

        A file of that name left by an earlier failed attempt at the same step is replaced."""
        (staging / name).unlink(missing_ok=True)
        write_chunks(staging / name, chunks)

    def discard(self, staging: Path) -> None:
        """Remove a staging directory that will never be committed."""
        shutil.rmtree(staging, ignore_errors=True)

    def read_manifest(self, location: Path) -> Manifest:
        return read_manifest(location)

    def read_data(self, location: Path, name: str, size: int, checksum: str) -> tuple[torch.Tensor, dict[str, Any]]:
        return read_data_file(location / name, size, checksum)

    def map_data(self, location: Path, name: str, size: int, checksum: str) -> tuple[torch.Tensor, dict[str, Any]]:
        """:meth:`read_data` of a file another process on this machine has just verified: mapped
        from the same page cache, its size and header checked, its bytes not hashed again."""
        return read_data_file(location / name, size, checksum, verified=True)

    def commit(self, staging: Path, step: int) -> Path:
        """Atomically publish a fully written and fsynced staging directory as checkpoint ``step``."""
        fsync_directory(staging)
        final = self.root / checkpoint_name(step)
        if final.is_symlink():  # never a checkpoint (never listed): the link goes, what it points to stays
            log.warning(
                "%s in %s is a symbolic link (to %s), not a checkpoint: replaced by the checkpoint just written",
                final.name,
                self.root,
                _link_target(final),
            )
            final.unlink()
            os.rename(staging, final)
            fsync_directory(self.root)
        elif final.exists():
            # A run restored from an older checkpoint reached this step again: the new one replaces it.
            trash = self.root / f"{final.name}.tmp-replaced-{uuid.uuid4().hex[:12]}"
            os.rename(final, trash)
            os.rename(staging, final)
            fsync_directory(self.root)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(staging, final)
            fsync_directory(self.root)
        return final

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Committed checkpoint directories as (step, path), newest first."""
        found = []
        for entry in os.scandir(self.root):
            step = checkpoint_step(entry.name)
            if step is not None and entry.is_dir(follow_symlinks=False):
                found.append((step, Path(entry.path)))
        return sorted(found, reverse=True)

    def linked_checkpoints(self) -> list[tuple[int, Path, str]]:
        """The ``step_N`` entries that are symbolic links, as (step, path, target), newest first: never
        listed by :meth:`checkpoints` (a checkpoint's directory is the run directory's own)."""
        found = []
        for entry in os.scandir(self.root):
            step = checkpoint_step(entry.name)
            if step is not None and entry.is_symlink():
                found.append((step, Path(entry.path), _link_target(Path(entry.path))))
        return sorted(found, reverse=True)

    def delete(self, path: Path) -> None:
        """Remove a committed checkpoint: hide it with one rename first, so a kill never leaves half of it visible."""
        hidden = path.with_name(f"{path.name}.tmp-deleting-{uuid.uuid4().hex[:12]}")
        os.rename(path, hidden)
        shutil.rmtree(hidden, ignore_errors=True)

    def set_aside(self, location: Path, reason: str, kind: Aside = Aside.DAMAGED) -> Path | None:
        """Rename the checkpoint ``location`` to ``step_N.damaged-<id>`` (``.abandoned-<id>``: see
        :class:`Aside`; atomic: it is listed or set aside, never half of each) and write its
        ``damaged.json``; None where it is left in place: gone already (deleted, or set aside by
        another process), or the directory cannot be changed (read-only)."""
        aside = location.with_name(f"{location.name}.{kind.value}-{uuid.uuid4().hex[:12]}")
        try:
            os.rename(location, aside)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning(
                "checkpoint %s of %s %s but cannot be set aside (%s): left in place",
                location.name,
                self.root,
                kind.describe(reason),
                e.strerror or e,
            )
            return None
        try:
            fsync_directory(self.root)
            (aside / DAMAGED_NAME).write_bytes(damaged_marker(reason, kind=kind))
        except OSError as e:  # the rename is what counts; the marker only says why
            log.info("could not record why %s was set aside: %s", aside, e)
        log.log(
            kind.level,
            "checkpoint %s of %s %s: set aside as %s; it is no longer listed, restored or counted by keep=",
            location.name,
            self.root,
            kind.describe(reason),
            aside.name,
        )
        return aside

    def set_aside_checkpoints(self) -> list[SetAside]:
        """The ``step_N.damaged-<id>`` and ``step_N.abandoned-<id>`` directories, newest first."""
        found = []
        for entry in os.scandir(self.root):
            match = _SET_ASIDE_NAME.match(entry.name)
            if match is None or not entry.is_dir(follow_symlinks=False):
                continue
            found.append(
                set_aside_of(
                    int(match.group(1)), Path(entry.path), read_marker(_read_small(Path(entry.path) / DAMAGED_NAME))
                )
            )
        return sorted(found, key=lambda a: (-a.step, a.name))


def _link_target(path: Path) -> str:
    """Where the symbolic link ``path`` points, as it says (``?`` if it is gone meanwhile)."""
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def _read_small(path: Path) -> bytes | None:
    """A marker's bytes, if it is a regular file (never block on a FIFO put in its place)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        with open(fd, "rb", buffering=0) as f:
            return f.read(MAX_MARKER_BYTES + 1) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except OSError:
        return None
