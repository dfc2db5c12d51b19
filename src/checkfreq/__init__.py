"""checkfreq: cheap, frequent, exact checkpointing for PyTorch training.

``Checkpointer`` takes a two-phase checkpoint (snapshot into reused host buffers, then a
background persist) whenever its policy says so, and ``restore()`` resumes exactly.
"""

from __future__ import annotations

__version__ = "0.1.0"

from checkfreq.checkpointer import Checkpointer
from checkfreq.restore import read_checkpoint
from checkfreq.data import ResumableLoader, ResumableSampler
from checkfreq.errors import (
    CheckfreqError,
    CorruptCheckpointError,
    DirectoryLockedError,
    ExistingCheckpointsError,
    NoValidCheckpointError,
    PersistError,
    ReplicaMismatchError,
    StateMismatchError,
    TopologyError,
    UnserializableStateError,
    UnsupportedTorchError,
)
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

__all__ = [
    "Auto",
    "CheckfreqError",
    "Checkpointer",
    "ConvergenceAware",
    "CorruptCheckpointError",
    "DecisionContext",
    "DirectoryLockedError",
    "Every",
    "ExistingCheckpointsError",
    "EveryEpoch",
    "NoValidCheckpointError",
    "Overhead",
    "PersistError",
    "Policy",
    "read_checkpoint",
    "ReplicaMismatchError",
    "ResumableLoader",
    "ResumableSampler",
    "StatefulPolicy",
    "StateMismatchError",
    "TopologyError",
    "UnserializableStateError",
    "UnsupportedTorchError",
    "YoungDaly",
]
