"""Agreeing on *when* to checkpoint under ``torch.distributed``, at a bounded cost.

A policy that measures time can answer differently on different ranks, yet every rank must
checkpoint at the same step. :class:`AgreedPolicy` asks the policy at every step, remembers a
"yes", and exchanges the answers only every so many steps — about every :data:`VOTE_SECONDS` of
training, and at least twice per interval the policy plans — in a vote that a background thread
carries up and down a tree of the ranks (:func:`checkfreq.ranks.collectives.tree_max`), collected at the
next step. The exchange is not free on busy CPUs (docs/distributed.md, "When."): voting at every
step of a 14 ms iteration cost about 6 % on two shared cores; voting every quarter second is within
the noise of a run that exchanges nothing.
"""

from __future__ import annotations

import concurrent.futures
import math
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from checkfreq.errors import CheckfreqError, PeerLostError
from checkfreq.policies import DecisionContext, Every, Policy
from checkfreq.ranks.collectives import POLL_S, Peers, tree_max
from checkfreq.ranks.liveness import Liveness

VOTE_SECONDS = 0.25
"""Training time between two exchanges of the ranks' answers: how late a checkpoint may come."""
VOTE_ACTIVITY = "the vote on when to checkpoint"
"""What the ranks do when they vote, as a lost rank's error says."""
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


def needs_agreement(policy: Policy) -> bool:
    """Whether the ranks must vote on ``policy``'s answers: not for a step count, the same on every rank."""
    return not (isinstance(policy, Every) and policy.n is not None)


def _planned_interval(policy: Policy) -> int:
    """The interval an adaptive policy plans now (its documented ``interval``), else 0."""
    interval = getattr(policy, "interval", 0)
    return interval if isinstance(interval, int) and not isinstance(interval, bool) else 0


@dataclass(frozen=True)
class Vote:
    """A rank's answer in the vote, and the vote's result (on the wire: two int64s, whose elementwise
    maximum over the ranks, :func:`~checkfreq.ranks.collectives.tree_max`, is the result)."""

    wanted: bool
    """This rank's policy asked for a checkpoint since the last vote (the result: some rank's did)."""
    steps: int
    """The steps to the next vote this rank proposes (the result: the fewest any rank proposes)."""

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([int(self.wanted), -self.steps], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> Vote:
        wanted, negated_steps = tensor.tolist()
        return cls(bool(wanted), -int(negated_steps))


class AgreedPolicy:
    """Wraps a policy whose answer may differ between ranks; every rank acts on the agreed answer.

    Each rank asks its policy at every step and remembers whether it said yes since the last
    exchange. At an exchange step it hands ``(wanted, −proposed steps to the next exchange)`` to
    its vote thread, which takes the maximum over the ranks with :func:`~checkfreq.ranks.collectives.tree_max`
    on ``peers`` (used by nothing else); the next step collects it, checkpoints if any rank wanted
    to, and schedules the next exchange by the smallest proposal, so every rank exchanges at the
    same steps and none waits longer than it proposed. The policy is not asked at the step that
    checkpoints (it could not know that its wish is being granted). A checkpoint thus comes at
    most one exchange period plus one step after a policy asked for it, and never at a step no
    rank asked for. A vote that fails, or brings no answer within ``timeout`` seconds, raises
    :class:`CheckfreqError` at that step and at every later one. With the ranks' ``liveness``, the
    training thread watches their heartbeats as it waits for the answer: a rank lost is named
    (:class:`PeerLostError`, and this process ends a failure timeout later, as after any wait on a
    lost rank), never mistaken for a rank that calls ``step()`` less often than the others.
    """

    def __init__(self, policy: Policy, peers: Peers, timeout: float, liveness: Liveness | None = None) -> None:
        self.policy = policy
        self._peers = peers
        self._timeout = timeout
        self._liveness = liveness
        self._calls = 0
        self._next_vote = 1
        self._wanted = False
        self._pending: Future[torch.Tensor] | None = None
        self._failure: CheckfreqError | None = None
        self._votes: queue.SimpleQueue[tuple[torch.Tensor, Future[torch.Tensor]] | None] = queue.SimpleQueue()
        threading.Thread(target=_vote, args=(peers, self._votes), name="checkfreq-vote", daemon=True).start()
        self._stop = weakref.finalize(self, self._votes.put, None)

    def should_save(self, ctx: DecisionContext) -> bool:
        self._calls += 1
        agreed = self._collect()
        if agreed:
            self._wanted = False
        elif self.policy.should_save(ctx):
            self._wanted = True
        if self._calls == self._next_vote:
            proposal = vote_steps(ctx.iteration_time, _planned_interval(self.policy))
            self._pending = Future()
            self._votes.put((Vote(self._wanted, proposal).to_tensor(), self._pending))
            self._wanted = False
        return agreed

    def _collect(self) -> bool:
        """The answer of the vote started at the previous step, if one was; schedules the next."""
        if self._failure is not None:
            raise self._failure
        if self._pending is None:
            return False
        pending, self._pending = self._pending, None
        try:
            agreed = Vote.from_tensor(self._answer(pending))
        except concurrent.futures.TimeoutError:
            self._failure = CheckfreqError(
                f"rank {self._peers.rank}: the ranks' vote on when to checkpoint brought no answer within "
                f"{self._timeout:g} s: every rank must call step() as often as the others, and all must be alive"
            )
            raise self._failure from None
        except PeerLostError as e:  # names the rank lost
            self._failure = e
            raise
        except Exception as e:
            self._failure = CheckfreqError(
                f"rank {self._peers.rank}: the ranks' vote on when to checkpoint failed ({type(e).__name__}: {e}); "
                "another rank may have died"
            )
            raise self._failure from e
        self._next_vote = self._calls - 1 + agreed.steps
        return agreed.wanted

    def _answer(self, pending: Future[torch.Tensor]) -> torch.Tensor:
        """The vote's answer, waited for ``timeout`` seconds; with a liveness, until a rank is found
        lost (:class:`PeerLostError`), or two heartbeats longer if none is: a rank silent for the
        timeout is then named before the wait ends."""
        liveness = self._liveness
        if liveness is None:
            return pending.result(timeout=self._timeout)
        deadline = time.monotonic() + self._timeout + 2 * liveness.interval
        while True:
            try:
                return pending.result(timeout=POLL_S)
            except concurrent.futures.TimeoutError:
                liveness.check(range(liveness.size), VOTE_ACTIVITY)
                if time.monotonic() > deadline:
                    raise

    def close(self) -> None:
        """Finish the vote in flight (every rank has started the same ones) and stop the vote thread."""
        try:
            if self._failure is None:  # a failure already raised is not raised again
                self._collect()
        finally:
            self._stop()


def _vote(peers: Peers, votes: queue.SimpleQueue[tuple[torch.Tensor, Future[torch.Tensor]] | None]) -> None:
    """The vote thread: each vote handed over, reduced over the ranks, its answer (or error) set."""
    while (vote := votes.get()) is not None:
        value, answer = vote
        try:
            answer.set_result(tree_max(peers, value))
        except Exception as e:  # the training thread raises it
            answer.set_exception(e)
