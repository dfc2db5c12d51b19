"""What a Checkpointer decides at ``step()``, and its capture at the step's consistent point.

:class:`Taker` asks the policy (through the cluster, which has the ranks agree), a memory tier's
cadence and a trapped signal at each step, holds what they decided in the
:class:`~checkfreq.pipeline.save.consistent_point.ConsistentPoint`, and captures it when the point comes:
a checkpoint through the :class:`~checkfreq.pipeline.save.saver.Saver`, or a snapshot into one tier alone.
It also makes the current state durable for ``save(blocking=True)``, a signal and a clean close.
The Checkpointer holds one and passes its calls on (docs/exactness.md, "The consistent point").
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from checkfreq.errors import ExistingCheckpointsError
from checkfreq.pipeline.capture.registered import Captured, Registered
from checkfreq.pipeline.save.consistent_point import ConsistentPoint, Pending, PointListener
from checkfreq.pipeline.save.saver import Saver
from checkfreq.pipeline.tiers.chosen import Tiers
from checkfreq.policies import Policy
from checkfreq.ranks.cluster import Cluster
from checkfreq.ranks.ddp_buckets import BucketLayouts
from checkfreq.run.session import run_state
from checkfreq.run.signals import SignalTrap


class Taker:
    """Decides at each step what to capture, and captures it at the step's consistent point.

    Args:
        objects: the registered objects (their loaders and modules mark the consistent point).
        registered: what captures and seals them.
        saver: takes, writes and commits checkpoints and tiers' snapshots.
        tiers: the places checkpoints live (a tier's own snapshots are due by its cadence).
        cluster: the ranks (the policy's answer is theirs together).
        policy: the policy (recorded in each checkpoint's run state).
        trap: the trapped signals, if any.
        directory: the local directory (named when it holds checkpoints this run did not restore).
        foreign_step: the newest step this run found and did not restore, if any.
    """

    def __init__(
        self,
        objects: Mapping[str, Any],
        registered: Registered,
        saver: Saver,
        tiers: Tiers,
        cluster: Cluster,
        policy: Policy,
        trap: SignalTrap | None,
        directory: str,
        foreign_step: int | None,
    ) -> None:
        self._registered, self._saver, self._tiers = registered, saver, tiers
        self._cluster, self._policy, self._trap = cluster, policy, trap
        self._directory = directory
        self.foreign_step = foreign_step
        """The newest step of checkpoints this run found and did not restore: none may be taken over them."""
        self.closed = False
        """The Checkpointer is closed: no point captures anything any more."""
        self.point = ConsistentPoint(objects.values(), PointListener(self))
        self._buckets = BucketLayouts(objects, cluster.world_size)

    # ------------------------------------------------------------------ deciding

    def decide(self, now: float, loss: float | None) -> bool:
        """``step()`` at ``time.perf_counter()`` ``now``: whether a checkpoint of this step is decided.
        What is decided (a checkpoint, tiers' own snapshots, a signal's checkpoint) waits for the point."""
        saver = self._saver
        saver.collect()
        saver.record_gpu_waits()
        self._registered.scores.stepped(saver.timeline.step + 1, loss)
        overdue = self.point.take()  # no point came before this step's update: taken at this step
        ctx = saver.advance(now, epoch=self._registered.epoch(), loss=loss)
        checkpoint = self._cluster.decide(ctx) or (overdue is not None and overdue.checkpoint)
        overdue_tiers = () if overdue is None else overdue.tiers
        due = [] if checkpoint else [*overdue_tiers, *self._tiers.due(ctx.step, ctx.iteration_time)]
        if checkpoint or due:
            self.check_not_foreign()  # refused now, not at the step's consistent point
        if checkpoint or due or self._signalled:
            self.point.hold(ctx.step, checkpoint=checkpoint, tiers=due, reason="policy")
        return checkpoint

    def at_point(self, where: str) -> None:
        """A consistent point (:mod:`~checkfreq.pipeline.save.consistent_point`): capture what waits for it."""
        if self.closed:
            return
        step = self._saver.timeline.step
        with self.point.reached(where, self._registered, self._cluster.control, step) as pending:
            if pending is not None:
                self._act(pending, where)

    # ------------------------------------------------------------------ capturing

    def checkpoint(self, *, blocking: bool, reason: str, at: str | None = None) -> None:
        """Capture and persist the state at the current step; ``at``: the consistent point (else ``reason``'s call)."""
        self.check_not_foreign()
        self._registered.sealed_at = reason if at is None else at
        self._saver.checkpoint(self._capture, epoch=self._registered.epoch, reason=reason, blocking=blocking)

    def holds_current_state(self) -> bool:
        """Whether the checkpoint of the current step (taken, maybe in flight) still holds the live state."""
        timeline = self._saver.timeline
        step = timeline.step
        return step != 0 and timeline.last_checkpoint == step and self._registered.holds(step, self._cluster.control)

    def ensure_durable(self, reason: str, timeout: float) -> None:
        """Make the state at the current step durable, reusing a checkpoint taken at this step if it committed
        and still holds the live state (waited for at most ``timeout`` seconds)."""
        if self.holds_current_state():
            self._saver.wait(timeout)
            if self._saver.durable_step == self._saver.timeline.step:
                return
        self.checkpoint(blocking=True, reason=reason)

    def persist_newest_state(self) -> None:
        """Where a rank writes a share of its state (not a tier's snapshot as it stands), before a clean
        close removes the tiers' snapshots: a collective blocking checkpoint if the ranks' newest tier
        snapshot (the same step on every rank) is at the current step and newer than disk."""
        self._saver.wait_tiers()
        held = self._tiers.unpersisted(self._saver.durable_step)
        if held is not None and held.step == self._saver.timeline.step:
            self.checkpoint(blocking=True, reason="close")

    def save_for_signal(self, timeout: float) -> None:
        """Preempted: make the current state durable, then let the signal act as it would have."""
        assert self._trap is not None  # called once a trapped signal was received
        self._trap.checkpoint_then_honour(
            self._saver.timeline.step, self._saver.events, lambda: self.ensure_durable("signal", timeout)
        )

    def check_not_foreign(self) -> None:
        """Refuse to checkpoint over checkpoints (or memory snapshots) this run did not restore."""
        if self.foreign_step is not None:
            raise ExistingCheckpointsError(self._directory, self.foreign_step)

    def replay_buckets(self, saved: Any) -> None:
        """A restored run: DDP's first iteration reduces in the buckets the saved run had (``saved``)."""
        self._buckets.replay(saved)

    # ------------------------------------------------------------------ internals

    @property
    def _signalled(self) -> bool:
        return self._trap is not None and self._trap.received is not None

    def _act(self, pending: Pending, where: str) -> None:
        """Capture what was decided: the signal's checkpoint, the policy's (or ``log()``'s), or the tiers' own
        snapshots; ``where``: the consistent point that came."""
        if self._signalled:
            self.save_for_signal(self._saver.timeout)
        if pending.checkpoint:
            self.checkpoint(blocking=False, reason=pending.reason, at=where)
            return
        capture = functools.partial(self._capture, persisted=False)
        for tier in pending.tiers:  # a snapshot into that tier alone
            self.check_not_foreign()
            self._saver.snapshot_for(tier, capture, epoch=self._registered.epoch)

    def _capture(self, step: int, *, persisted: bool = True) -> Captured:
        """The registered state at ``step``, sealed (``persisted``: for a checkpoint, not a tier's own snapshot)."""
        run = functools.partial(
            run_state,
            step,
            self._registered.optimizers,
            self._saver.profiler,
            self._policy,
            ddp_buckets=self._buckets.record(),
        )
        return self._registered.capture(step, run, persisted=persisted)
