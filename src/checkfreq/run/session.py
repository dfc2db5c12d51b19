"""What a run has learned, carried from one session to the next inside its checkpoints.

Each checkpoint holds a reserved ``checkfreq`` entry (plain JSON): the global step, the class of
each registered optimizer (checked on restore), the profiler's estimates and, for a stateful
policy, its state. A restored session is seeded with them and re-validates them against its own
measurements (docs/policies.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from checkfreq.policies import Policy, StatefulPolicy
from checkfreq.policies.profiler import Profiler
from checkfreq.run.state import type_name

log = logging.getLogger("checkfreq")


DDP_BUCKETS = "ddp_buckets"
"""The entry of the ``checkfreq`` state that holds DDP's rebuilt buckets (:mod:`checkfreq.ranks.ddp_buckets`)."""


def run_state(
    step: int,
    optimizers: Mapping[str, torch.optim.Optimizer],
    profiler: Profiler,
    policy: Policy,
    ddp_buckets: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The reserved ``checkfreq`` entry of a checkpoint taken at ``step`` (with DDP's buckets, if any)."""
    state: dict[str, Any] = {
        "global_step": step,
        "optimizer_types": {name: type_name(opt) for name, opt in optimizers.items()},
        "profile": profiler.state_dict(),
    }
    if isinstance(policy, StatefulPolicy):
        state["policy"] = {"type": type(policy).__name__, "state": policy.state_dict()}
    if ddp_buckets:
        state[DDP_BUCKETS] = dict(ddp_buckets)
    return state


def saved_buckets(saved: Any) -> Mapping[str, Any]:
    """DDP's buckets in a restored ``checkfreq`` entry (none in one saved without them)."""
    buckets = saved.get(DDP_BUCKETS) if isinstance(saved, dict) else None
    return buckets if isinstance(buckets, dict) else {}


def seed_session(saved: Any, policy: Policy) -> tuple[Profiler, list[str]]:
    """A profiler for the restored session, seeded with the saved estimates, and ``policy``
    resumed from its saved state; returns the profiler and what was seeded.

    A state that does not fit (an older checkpoint, another policy or configuration) is left out
    with a warning: the session then profiles from scratch, which is slower to settle but never wrong.
    """
    profiler = Profiler()
    saved = saved if isinstance(saved, dict) else {}
    seeded = []
    if "profile" in saved:
        try:
            profiler.load_state_dict(saved["profile"])
            seeded.append("profile")
        except (ValueError, TypeError, AttributeError) as e:
            log.warning("not resuming the saved profile (%s); this session profiles afresh", e)
    saved_policy = saved.get("policy")
    if isinstance(policy, StatefulPolicy) and saved_policy is not None:
        name = type(policy).__name__
        try:
            if not isinstance(saved_policy, dict) or saved_policy.get("type") != name:
                saved_type = saved_policy.get("type") if isinstance(saved_policy, dict) else saved_policy
                raise ValueError(f"it was saved by policy {saved_type!r}, this run uses {name}")
            policy.load_state_dict(saved_policy["state"])
            seeded.append("policy")
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            log.warning(
                "not resuming the saved state of the %s policy (%s); it plans afresh from this session's measurements",
                name,
                e,
            )
    return profiler, seeded
