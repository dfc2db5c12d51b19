"""When to checkpoint and what to keep: pure decision objects, the closed forms behind them, the
profiler that feeds them, the memory tier's cadence and the retention rule.

A policy answers :meth:`Policy.should_save` from a read-only :class:`DecisionContext`; it
never touches torch or storage, so it can be unit-tested with plain numbers. Adaptive policies
expose their current decision as ``interval`` (steps between checkpoints) and ``reason`` (why
that interval now), and log every change on the ``checkfreq.policies`` logger.

Sessions: a run that is restored starts a new session (a new process, a fresh profiler). A policy
that needs measurements waits ``warmup`` steps of *this* session and a measured iteration time
before any checkpoint: a missing measurement means "wait and measure", never "checkpoint now".
What a policy learned travels in every checkpoint through :meth:`StatefulPolicy.state_dict` (plain
JSON) and seeds the resumed session's policy, which re-validates it against the fresh
measurements (docs/policies.md, "Sessions and restarts").

Imports: ``errors`` only (no torch, no storage). The policies users name are re-exported here.
"""

from checkfreq.policies.auto import Auto, resolve
from checkfreq.policies.base import DecisionContext, Policy, StatefulPolicy
from checkfreq.policies.convergence import ConvergenceAware
from checkfreq.policies.failures import YoungDaly
from checkfreq.policies.fixed import Every, EveryEpoch
from checkfreq.policies.overhead import Overhead
from checkfreq.policies.retention import Retention

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
