"""The exceptions checkfreq raises. Every one derives from :class:`CheckfreqError`.

Where callers expect a builtin type, the error is that type too: a bad argument is a
``ValueError`` (:class:`InvalidArgumentError`), a misspelled option a ``TypeError``
(:class:`ArgumentTypeError`), a missing checkpoint directory a ``FileNotFoundError``, and so on.
"""

from __future__ import annotations


class CheckfreqError(Exception):
    """Base class of all checkfreq errors."""


class CorruptCheckpointError(CheckfreqError):
    """A checkpoint on storage is incomplete, damaged or malformed; the message says why."""


class NoValidCheckpointError(CheckfreqError):
    """Checkpoints exist but none of them is valid: the message names the steps and tiers tried, each
    reason, and the ways out."""


class StateMismatchError(CheckfreqError):
    """A checkpoint does not fit the registered objects: missing/unexpected keys, shapes or dtypes."""


class UnserializableStateError(CheckfreqError):
    """A registered value cannot be stored without pickling, and pickling was not allowed."""


class PersistError(CheckfreqError):
    """The background writer failed to persist a checkpoint (the cause is chained)."""


class PersistTimeoutError(PersistError, TimeoutError):
    """A wait on a background copy, persist or upload took longer than ``persist_timeout``."""


class DirectoryLockedError(CheckfreqError):
    """Another live process is already checkpointing into the same directory."""


class ExistingCheckpointsError(CheckfreqError):
    """A run would checkpoint into a directory holding another run's checkpoints without restoring them.

    Args:
        directory: the directory.
        newest_step: the newest of the checkpoints (or memory snapshots) it holds.
    """

    def __init__(self, directory: str, newest_step: int) -> None:
        super().__init__(
            f"{directory} already holds checkpoints (the newest at step {newest_step}) and this run did not restore "
            "them: its checkpoints would be written beside and over them. Call restore() before training to resume "
            "from them (resume=True for CheckFreqCallback, resume_from_checkpoint=True for CheckFreqTrainer), or "
            "give this run a directory of its own."
        )
        self.directory, self.newest_step = directory, newest_step


class ReplicaMismatchError(CheckfreqError):
    """Ranks hold different values, dtypes or shapes for state stored once; names the entries and ranks."""


class TopologyError(CheckfreqError):
    """A data loader's partition over the ranks does not match the job's rank and world size."""


class UnsupportedTorchError(CheckfreqError):
    """The running torch lacks an API that checkfreq needs for what was asked of it."""


class InvalidArgumentError(CheckfreqError, ValueError):
    """An argument or option has a value checkfreq cannot use; the message names it and what it takes."""


class ArgumentTypeError(CheckfreqError, TypeError):
    """An argument has the wrong type, or a keyword is not one the call takes (the message names the closest)."""


class UnsupportedDtypeError(UnserializableStateError, TypeError):
    """A registered tensor has a dtype that checkpoint files cannot hold (complex numbers, for one)."""


class UnknownObjectError(CheckfreqError, KeyError):
    """A checkpoint holds no object of the name asked for; the message lists the names it holds."""


class UsageError(CheckfreqError, RuntimeError):
    """An object is used when it cannot serve: a stale loader iterator, a callback's checkpointer outside a fit."""


class CheckpointDirectoryError(CheckfreqError, OSError):
    """A checkpoint directory cannot be created, found or written; the message gives the path and the reason."""


class CheckpointNotFoundError(CheckpointDirectoryError, FileNotFoundError):
    """A checkpoint directory, or a checkpoint named on the command line, does not exist."""


class DirectoryNotWritableError(CheckpointDirectoryError, PermissionError):
    """Checkpoints could not be written into a directory (read-only filesystem, permissions, a refusing store)."""


class PeerLostError(CheckfreqError):
    """Another rank stopped answering (its process died, its node vanished, or it left on an error)
    while this rank waited for it; the message names the rank, its host and pid, and what the ranks
    were doing. This rank gives up so that torchrun can restart the job (``failure_timeout``)."""
