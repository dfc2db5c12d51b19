"""When to checkpoint and what to keep: pure decision objects, the closed forms behind them, the
profiler that feeds them, the memory tier's cadence and the retention rule.

Imports: ``errors`` only (no torch, no storage). The policies users name are re-exported here.
"""

from checkfreq.policies.retention import Retention
from checkfreq.policies.rules import (
    Auto,
    ConvergenceAware,
    DecisionContext,
    Every,
    EveryEpoch,
    Overhead,
    Policy,
    StatefulPolicy,
    YoungDaly,
    resolve,
)

__all__ = [
    "Auto",
    "ConvergenceAware",
    "DecisionContext",
    "Every",
    "EveryEpoch",
    "Overhead",
    "Policy",
    "Retention",
    "StatefulPolicy",
    "YoungDaly",
    "resolve",
]
