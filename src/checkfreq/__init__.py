"""checkfreq: cheap, frequent, exact checkpointing for PyTorch training.

``Checkpointer`` takes a two-phase checkpoint (snapshot into reused host buffers, then a
background persist) whenever its policy says so, and ``restore()`` resumes exactly.
"""

from __future__ import annotations

from checkfreq.checkpointer import Checkpointer
from checkfreq.data import ResumableLoader, ResumableSampler
from checkfreq.errors import (
    ArgumentTypeError,
    CheckfreqError,
    CheckpointDirectoryError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DirectoryLockedError,
    DirectoryNotWritableError,
    ExistingCheckpointsError,
    InvalidArgumentError,
    NoValidCheckpointError,
    PeerLostError,
    PersistError,
    PersistTimeoutError,
    ReplicaMismatchError,
    StateMismatchError,
    TopologyError,
    UnknownObjectError,
    UnserializableStateError,
    UnsupportedDtypeError,
    UnsupportedTorchError,
    UsageError,
)
from checkfreq.pipeline.restore import read_checkpoint
from checkfreq.policies import (
    Auto,
    ConvergenceAware,
    DecisionContext,
    Every,
    EveryEpoch,
    Overhead,
    Policy,
    StatefulPolicy,
    YoungDaly,
)
from checkfreq.policies.retention import Retention
from checkfreq.version import __version__ as __version__

__all__ = [
    "ArgumentTypeError",
    "Auto",
    "CheckfreqError",
    "CheckpointDirectoryError",
    "Checkpointer",
    "CheckpointNotFoundError",
    "ConvergenceAware",
    "CorruptCheckpointError",
    "DecisionContext",
    "DirectoryLockedError",
    "DirectoryNotWritableError",
    "Every",
    "EveryEpoch",
    "ExistingCheckpointsError",
    "InvalidArgumentError",
    "NoValidCheckpointError",
    "Overhead",
    "PeerLostError",
    "PersistError",
    "PersistTimeoutError",
    "Policy",
    "read_checkpoint",
    "ReplicaMismatchError",
    "ResumableLoader",
    "Retention",
    "ResumableSampler",
    "StatefulPolicy",
    "StateMismatchError",
    "TopologyError",
    "UnknownObjectError",
    "UnserializableStateError",
    "UnsupportedDtypeError",
    "UnsupportedTorchError",
    "UsageError",
    "YoungDaly",
]
