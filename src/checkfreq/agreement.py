"""Agreeing on *when* to checkpoint under ``torch.distributed``, at a bounded cost.

A policy that measures time can answer differently on different ranks, yet every rank must
checkpoint at the same step. :class:`AgreedPolicy` asks the policy at every step, remembers a
"yes", and exchanges the answers only every so many steps — about every :data:`VOTE_SECONDS` of
training, and at least twice per interval the policy plans — in a non-blocking all-reduce
collected at the next step. The exchange is not free on busy CPUs (docs/distributed.md,
"When."): voting at every step of a 14 ms iteration cost about 6 % on two shared cores; voting
every quarter second is within the noise of a run that exchanges nothing.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from checkfreq.policies import DecisionContext, Policy

VOTE_SECONDS = 0.25
"""Training time between two exchanges of the ranks' answers: how late a checkpoint may come."""
MAX_VOTE_STEPS = 1000
"""No more steps than this between two exchanges, however short the iterations."""


def vote_steps(iteration_time: float, interval: int = 0) -> int:
    """Steps between two exchanges: about :data:`VOTE_SECONDS` of training and at most half the
    policy's planned ``interval`` (steps; 0 if it plans none), so that a checkpoint comes at most
    half an interval late and the exchanges cost at most two per checkpoint. Every step until
    the iteration time is measured."""
    if not (iteration_time > 0 and math.isfinite(iteration_time)):
        return 1
    steps = math.ceil(VOTE_SECONDS / iteration_time)
    if interval > 0:
        steps = min(steps, interval // 2)
    return max(1, min(MAX_VOTE_STEPS, steps))


def _planned_interval(policy: Policy) -> int:
    """The interval an adaptive policy plans now (its documented ``interval``), else 0."""
    interval = getattr(policy, "interval", 0)
    return interval if isinstance(interval, int) and not isinstance(interval, bool) else 0


class AgreedPolicy:
    """Wraps a policy whose answer may differ between ranks; every rank acts on the agreed answer.

    Each rank asks its policy at every step and remembers whether it said yes since the last
    exchange. At an exchange step it starts a non-blocking MAX all-reduce of ``(wanted, −proposed
    steps to the next exchange)``; the next step collects it, checkpoints if any rank wanted to,
    and schedules the next exchange by the smallest proposal, so every rank exchanges at the same
    steps and none waits longer than it proposed. The policy is not asked at the step that
    checkpoints (it could not know that its wish is being granted). A checkpoint thus comes at
    most one exchange period plus one step after a policy asked for it, and never at a step no
    rank asked for.
    """

    def __init__(self, policy: Policy, group: Any) -> None:
        self.policy = policy
        self._group = group
        self._calls = 0
        self._next_vote = 1
        self._wanted = False
        self._vote = torch.zeros(2, dtype=torch.int64)
        self._work: Any = None

    def should_save(self, ctx: DecisionContext) -> bool:
        self._calls += 1
        agreed = self._collect()
        if agreed:
            self._wanted = False
        elif self.policy.should_save(ctx):
            self._wanted = True
        if self._calls == self._next_vote:
            proposal = vote_steps(ctx.iteration_time, _planned_interval(self.policy))
            self._vote = torch.tensor([int(self._wanted), -proposal], dtype=torch.int64)
            self._work = dist.all_reduce(self._vote, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
            self._wanted = False
        return agreed

    def _collect(self) -> bool:
        """The answer of the exchange started at the previous step, if one was; schedules the next."""
        if self._work is None:
            return False
        self._work.wait()
        self._work = None
        wanted, negated_period = (int(v) for v in self._vote.tolist())
        self._next_vote = self._calls - 1 - negated_period
        return bool(wanted)

    def close(self) -> None:
        """Finish the exchange in flight (every rank has started the same ones)."""
        self._collect()
