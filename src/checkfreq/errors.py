"""The exceptions checkfreq raises. Every one derives from :class:`CheckfreqError`."""

from __future__ import annotations


class CheckfreqError(Exception):
    """Base class of all checkfreq errors."""


class CorruptCheckpointError(CheckfreqError):
    """A checkpoint on storage is incomplete, damaged or malformed; the message says why."""


class NoValidCheckpointError(CheckfreqError):
    """Checkpoints exist but none of them is valid (each reason is in the message)."""


class StateMismatchError(CheckfreqError):
    """A checkpoint does not fit the registered objects: missing/unexpected keys, shapes or dtypes."""


class UnserializableStateError(CheckfreqError):
    """A registered value cannot be stored without pickling, and pickling was not allowed."""


class PersistError(CheckfreqError):
    """The background writer failed to persist a checkpoint (the cause is chained)."""


class DirectoryLockedError(CheckfreqError):
    """Another live process is already checkpointing into the same directory."""


class ExistingCheckpointsError(CheckfreqError):
    """A run would checkpoint into a directory holding another run's checkpoints without restoring them."""


class ReplicaMismatchError(CheckfreqError):
    """Ranks hold different values, dtypes or shapes for state stored once; names the entries and ranks."""


class TopologyError(CheckfreqError):
    """A data loader's partition over the ranks does not match the job's rank and world size."""


class UnsupportedTorchError(CheckfreqError):
    """The running torch lacks an API that checkfreq needs for what was asked of it."""
