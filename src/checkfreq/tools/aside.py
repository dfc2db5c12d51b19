"""Damaged checkpoints set aside, from a shell: ``checkfreq verify`` sets aside each checkpoint it
fails, and ``checkfreq ls`` lists those set aside apart from the others.

A checkpoint set aside (:meth:`checkfreq.storage.Store.set_aside`) is out of its store's listing: no
restore reads it and retention does not count it toward ``keep``, so a run keeps ``keep``
checkpoints that restore. Its files stay, for inspection, until retention deletes it (once ``keep``
valid checkpoints are newer); putting it back is a rename (``step_N.damaged-<id>`` to ``step_N``) in
a local directory, or deleting its ``damaged.json`` in an object store.

``verify`` sets aside only what it found damaged in the directory itself (not what a node-local
directory's checkpoint lacks in the remote tier), and in a local directory only while it can hold the
directory's writer lock: a running job's directory is left as it is (the job's own restore sets
aside what it skips), and so is a directory it cannot change (read-only).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from checkfreq.errors import CorruptCheckpointError, DirectoryLockedError
from checkfreq.storage import Store, open_store
from checkfreq.storage.base import SetAside
from checkfreq.storage.format import checkpoint_name, checkpoint_step
from checkfreq.storage.local import LocalStore
from checkfreq.tools.catalog import CheckpointRef, CheckpointStatus, checkpoint_bytes


def set_aside_statuses(root: str | os.PathLike[str] | Store) -> list[CheckpointStatus]:
    """The checkpoints of the run at ``root`` set aside (damaged, or of a course the run left), newest
    first: invalid, with the reason their marker records and :attr:`~CheckpointStatus.set_aside` their name now."""
    store = root if not isinstance(root, (str, os.PathLike)) else open_store(root, create=False)
    return [_status(store, aside) for aside in store.set_aside_checkpoints()]


def _status(store: Store, aside: SetAside) -> CheckpointStatus:
    ref = CheckpointRef(store, aside.location)
    try:
        manifest = ref.read_manifest()
    except (CorruptCheckpointError, OSError):
        manifest = None
    return CheckpointStatus(
        name=checkpoint_name(aside.step),
        path=ref.address,
        step=aside.step,
        epoch=manifest.epoch if manifest else None,
        bytes=checkpoint_bytes(ref, manifest),
        created=manifest.created if manifest else aside.when,
        valid=False,
        reason=aside.reason,
        checksummed=False,
        set_aside=aside.name,
    )


def set_aside_damaged(store: Store, statuses: Sequence[CheckpointStatus]) -> tuple[list[CheckpointStatus], str | None]:
    """Set aside each checkpoint of ``statuses`` (checked in ``store``) found damaged in ``store``
    itself; return the statuses, those set aside with :attr:`~CheckpointStatus.set_aside` filled,
    and why some were not (a job holds the directory, or it cannot be changed), else None. Never raises
    for a store it cannot change: what cannot be moved is left in place. The store's own log lines are
    kept out of the output (the statuses say it all, once) and what they say of a failure is the note."""
    damaged = [s for s in statuses if s.damaged_here and checkpoint_step(s.name) is not None]
    if not damaged:
        return list(statuses), None
    locked = isinstance(store, LocalStore)
    if isinstance(store, LocalStore):
        try:
            store.lock()
        except DirectoryLockedError:
            return list(statuses), f"a checkfreq job holds {store.root}: left in place (its restore sets them aside)"
        except OSError as e:
            return list(statuses), f"{store.root} cannot be changed ({e.strerror or e}): left in place"
    moved, failures = {}, []
    try:
        for status in damaged:
            step = checkpoint_step(status.name)
            assert step is not None  # filtered above
            with _captured("checkfreq.storage", type(store).__module__) as said:
                where = store.set_aside(store.location(step), status.reason or "damaged")
            if where is not None:
                moved[status.name] = str(where.name)
            else:
                failures += said
    finally:
        if locked:
            store.unlock()
    note = f"left in place: {'; '.join(failures)}" if failures else None
    return [dataclasses.replace(s, set_aside=moved[s.name]) if s.name in moved else s for s in statuses], note


@contextmanager
def _captured(*names: str) -> Iterator[list[str]]:
    """The messages the loggers ``names`` are given meanwhile, kept from their handlers."""
    said: list[str] = []
    loggers = [logging.getLogger(name) for name in dict.fromkeys(names)]

    def keep(record: logging.LogRecord) -> bool:
        said.append(record.getMessage())
        return False

    for logger in loggers:
        logger.addFilter(keep)
    try:
        yield said
    finally:
        for logger in loggers:
            logger.removeFilter(keep)
