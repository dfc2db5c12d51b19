"""The training thread's side of every checkpoint: the snapshot (into a tier's target or a buffer of
its own), the persist handed to the writer wrapped by the tiers, a snapshot taken for a tier alone,
the fence before the next optimizer step, and what the background returns.

The Checkpointer decides *when* and *what* (its registered state, captured by a callable it passes);
a :class:`Saver` does the rest the same way at every world size and with any tiers.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from checkfreq.errors import CheckfreqError, PeerLostError, PersistError, ReplicaMismatchError
from checkfreq.pipeline.capture.fence import Fence, FenceWait
from checkfreq.pipeline.capture.snapshot import Snapshotter
from checkfreq.pipeline.capture.writer import Writer
from checkfreq.pipeline.save.commit import CommitJob, CommitResult, Committer
from checkfreq.pipeline.tiers.chosen import Tiers
from checkfreq.pipeline.tiers.roles import HeldSnapshot, SnapshotRequest, SnapshotTaker
from checkfreq.policies.base import DecisionContext
from checkfreq.policies.profiler import Profiler
from checkfreq.ranks.cluster import Cluster
from checkfreq.run.busy import MEMORY, PERSIST, BusyStorage
from checkfreq.run.events import EventLog
from checkfreq.run.tensors import any_cuda, is_dtensor
from checkfreq.run.timeline import Timeline
from checkfreq.version import versions

log = logging.getLogger("checkfreq")

Capture = Callable[[int], tuple[Any, dict[str, torch.Tensor], set[str]]]
"""The registered state at a step: (skeleton, tensors, names of the tensors copied behind the fence)."""

Epoch = Callable[[], int | None]
"""The epoch a checkpoint is labelled with, read right after its capture (which may move a loader
on to the next epoch: its state then says "next epoch, nothing taken", and so does the label)."""


class Saver:
    """Takes checkpoints and tier snapshots for one Checkpointer (see the module docstring).

    Args:
        tiers: the Checkpointer's tiers.
        cluster: the ranks it checkpoints with.
        committer: runs the commit protocol on the writer thread.
        events: the run's event log.
        objects: the registered objects (what the cluster selects a rank's share from).
        gpu_staging: the Checkpointer's ``gpu_staging`` option.
        timeout: ``persist_timeout``.
        on_error: ``"raise"`` or ``"warn"`` (the Checkpointer's option).
        policy_name: what the events call the policy.
    """

    def __init__(
        self,
        tiers: Tiers,
        cluster: Cluster,
        committer: Committer,
        events: EventLog,
        objects: Mapping[str, Any],
        *,
        gpu_staging: bool | None,
        timeout: float,
        on_error: str,
        policy_name: str,
    ) -> None:
        self.tiers, self.cluster, self.committer, self.events = tiers, cluster, committer, events
        self.objects = objects
        self.timeout, self.on_error, self.policy_name = timeout, on_error, policy_name
        self.writer = Writer()
        self.snapshotter = Snapshotter(gpu_staging)
        self.fence = Fence()
        self.busy = BusyStorage(events)
        for tier in tiers.takers:
            tier.report_to(events.write)
        self.profiler = Profiler()
        """What checkpoints cost here (replaced by the restored session's, seeded)."""
        self.timeline = Timeline()
        """The session's steps and checkpoints (replaced at a restore)."""
        self.durable_step = -1
        """The newest step known committed to disk (a result of the writer, or restored)."""
        self.committed = -1
        """The newest step this session committed."""

    # ------------------------------------------------------------------ checkpoints

    def advance(self, now: float, *, epoch: int | None, loss: float | None) -> DecisionContext:
        """Count an optimizer step that ended at ``now``: measure its iteration, and what a policy decides from."""
        timeline = self.timeline
        measured = timeline.advance(now, writer_busy=self.writer.busy, writer_transitions=self.writer.transitions)
        if measured is not None:
            timeline.set_aside(self.profiler.record_iteration(measured[0], persisting=measured[1]))
        return timeline.context(now, self.profiler, persist_in_flight=self.writer.busy, epoch=epoch, loss=loss)

    def checkpoint(self, capture: Capture, *, epoch: Epoch, reason: str, blocking: bool) -> None:
        """Snapshot the state at the current step and persist it in the background (or, ``blocking``,
        before returning, raising if it failed)."""
        start = time.perf_counter()
        timeline, busy, profiler = self.timeline, self.busy, self.profiler
        timeline.reached_point(start, profiler)
        step = timeline.step
        # the host buffer is reused: one checkpoint in flight
        asked = reason == "policy"  # a retake by log(), save() or close() is no interval the user chose
        busy.wait(
            PERSIST,
            step,
            self.writer.busy,
            lambda: self.writer.wait(self.timeout),
            profiler,
            step - timeline.last_checkpoint if asked else None,
            asked=asked,
            since_previous=start - timeline.last_checkpoint_time,
        )
        self.collect()
        busy.wait(MEMORY, step, self.tiers.busy, self.wait_tiers, profiler, asked=asked)
        self.finish_fence()
        skeleton, tensors, owned = capture(step)
        epoch_label = epoch()
        tensors, owned, share = self.cluster.select(tensors, owned, self.objects, self.snapshotter.is_device)
        profiler.begin_checkpoint()
        layout = self.snapshotter.layout_of(tensors)
        placement = None
        if self.cluster.writes_whole_state:  # else the share has a buffer of its own
            placement = self.tiers.place(self._request(layout, skeleton, step, epoch_label, tensors))
        pending = self.snapshotter.take(
            tensors,
            owned,
            layout=layout,
            buffer=None if placement is None else placement.target.buffer,
            views=None if placement is None else placement.target.views,
            step=step,
            aside=None if share is None else share["later"],  # the replica claim's device pieces, for the writer
        )
        job: Callable[[], CommitResult] = functools.partial(
            self.committer.run, CommitJob(step, epoch_label, pending, skeleton, share, versions(), start)
        )
        self.writer.submit(self.tiers.around_persist(placement, pending, job))
        window = timeline.checkpointed(start)
        stall = time.perf_counter() - start
        self.events.write(
            "snapshot",
            step=step,
            stall_s=stall,
            bytes=pending.layout.nbytes,
            reason=reason,
            policy=self.policy_name,
            epoch=epoch_label,
            **window,
            iteration_s=profiler.iteration.value,
            iteration_persisting_s=profiler.iteration_while_persisting.value,
        )
        if pending.has_deferred:
            self.fence.arm(pending, self.writer, stall, functools.partial(self._account_persist_fence, step))
        else:
            profiler.record_stall(stall)
        if blocking:
            self.writer.wait(self.timeout)
            self.finish_fence()
            error = self.apply_commits(*self.writer.drain(), step)
            if isinstance(error, ReplicaMismatchError):
                raise error
            if error is not None:  # the caller waits for this very checkpoint: raise whatever on_error says
                raise PersistError(f"checkpoint at step {step} failed: {error}") from root_cause(error)

    def snapshot_for(self, tier: SnapshotTaker, capture: Capture, *, epoch: Epoch) -> None:
        """Snapshot the state at the current step into ``tier`` alone (its own cadence said so; no persist)."""
        start = time.perf_counter()
        self.timeline.reached_point(start, self.profiler)
        step = self.timeline.step
        self.busy.wait(MEMORY, step, tier.busy, self.wait_tiers, self.profiler)
        self.finish_fence()
        skeleton, tensors, owned = capture(step)
        epoch_label = epoch()
        tensors, owned, split = tier.share(tensors, owned, self.objects, skeleton)
        layout = self.snapshotter.layout_of(tensors)
        target = tier.target(self._request(layout, skeleton, step, epoch_label, tensors, split))
        if target is None:  # the tier turned itself off (no room, state it does not take)
            self.profiler.record_memory_stall(time.perf_counter() - start)
            return
        pending = self.snapshotter.take(
            tensors, owned, layout=layout, buffer=target.buffer, views=target.views, step=step, memory=True
        )
        writer = tier.submit(target, pending, skeleton, epoch_label)
        stall = time.perf_counter() - start
        self.events.write(str(tier.name), step=step, stall_s=stall, bytes=layout.nbytes)
        self.profiler.record_memory_stall(stall)  # creating the target included: none of it is training
        cost = stall - target.setup_s  # creating the target is a one-time cost
        if pending.has_deferred:
            self.fence.arm(pending, writer, cost, functools.partial(self._account_tier_fence, tier))
        else:
            tier.record_cost(cost)

    @property
    def newest_committed(self) -> int | None:
        """The newest step this session committed, if any."""
        return self.committed if self.committed >= 0 else None

    def close_tiers(self, *, remove: bool) -> None:
        """At a clean close: persist the newest snapshot a tier holds as it stands if disk is behind it
        and it is the whole checkpoint, bring the newest checkpoint to the tiers that copy them, then
        close the tiers (with ``remove``, the memory tier's region is removed) and give back the
        snapshot buffers (host and device)."""
        self.wait_tiers()
        held = self.tiers.unpersisted(self.durable_step)
        if held is not None and self.cluster.writes_whole_state:
            try:
                self._persist_held(held)
            except CheckfreqError:
                self.tiers.close(remove=False, timeout=self.timeout)  # the tier keeps the newest state
                raise
        self.tiers.flush(self.newest_committed, self.timeout)
        self.tiers.close(remove=remove, timeout=self.timeout)
        self.snapshotter.close()

    def _persist_held(self, held: HeldSnapshot) -> None:
        """Persist, and wait for, a snapshot a tier holds as it stands."""
        start = time.perf_counter()
        self.events.write(
            "snapshot",
            step=held.step,
            stall_s=0.0,
            bytes=held.pending.layout.nbytes,
            reason="close",
            policy=self.policy_name,
            epoch=held.epoch,
        )
        self.writer.submit(
            functools.partial(
                self.committer.run,
                CommitJob(held.step, held.epoch, held.pending, held.skeleton, None, versions(), start),
            )
        )
        error = self.apply_commits(*self.writer.drain(self.timeout), held.step)
        if error is not None:
            raise PersistError(
                f"persisting the newest memory snapshot (step {held.step}) at close failed: {error}"
            ) from error

    @staticmethod
    def _request(
        layout: Any,
        skeleton: Any,
        step: int,
        epoch: int | None,
        tensors: dict[str, torch.Tensor],
        split: dict[str, Any] | None = None,
    ) -> SnapshotRequest:
        return SnapshotRequest(
            layout,
            skeleton,
            step,
            epoch,
            versions(),
            time.time(),
            device_copies=any_cuda(tensors.values()),
            sharded=any(is_dtensor(t) for t in tensors.values()),
            split=split,
        )

    # ------------------------------------------------------------------ the fence and the waits

    def finish_fence(self) -> None:
        """Wait until the deferred copies of the last snapshot are done (called before the state changes)."""
        self.fence.finish(self.timeout)

    def _account_persist_fence(self, step: int, done: FenceWait) -> None:
        self.profiler.record_stall(done.stall_s)
        self.events.write("fence", step=step, wait_s=done.wait_s, stall_s=done.stall_s)

    def _account_tier_fence(self, tier: SnapshotTaker, done: FenceWait) -> None:
        self.profiler.record_memory_stall(done.wait_s)
        tier.record_cost(done.stall_s)

    def record_gpu_waits(self) -> None:
        """Once per step: add the training streams' waits on snapshot copies, timed on the GPU, to their
        costs (a whole step has run: the staging buffer can be sized against its peak memory)."""
        self.snapshotter.stepped = True
        for wait in self.snapshotter.gpu_waits.collect():
            self.events.write("gpu_wait", step=wait.step, wait_s=wait.seconds, at=wait.at, memory=wait.memory)
            if wait.memory:
                self.tiers.record_device_wait(wait.seconds)
            else:
                self.profiler.record_device_wait(wait.seconds)

    def wait_tiers(self) -> None:
        """Wait for the tiers' own snapshots in flight; a failed one is reported like a persist error."""
        failed = self.tiers.wait(self.timeout)
        if failed is not None:
            tier, error = failed
            self.report_failure(PersistError(f"{tier.name} tier snapshot failed: {error}"), error)

    def wait(self, timeout: float) -> None:
        """Block until the checkpoint in flight is durable and the tiers' snapshots committed."""
        self.writer.wait(timeout)
        self.collect()
        self.wait_tiers()

    # ------------------------------------------------------------------ what the background returns

    def collect(self) -> None:
        """Apply what the writer committed; raise (or log) what failed in the background."""
        error = self.apply_commits(self.writer.take_results(), self.writer.take_error(), self.timeline.last_checkpoint)
        if error is not None:
            if isinstance(error, (ReplicaMismatchError, PeerLostError)):  # not the storage's fault: always raised
                raise error
            self.report_failure(PersistError(f"checkpoint persist failed: {error}"), error)
        for tier, tier_error in self.tiers.take_errors():
            if isinstance(tier_error, PeerLostError):
                raise tier_error
            self.events.write("error", step=self.committed, message=str(tier_error))
            self.report_failure(PersistError(tier.describe_error(tier_error)), tier_error)

    def report_failure(self, error: PersistError, cause: BaseException) -> None:
        if self.on_error == "warn":
            log.warning("%s; training goes on", error)
            return
        raise PersistError(
            f'{error}. Training stops here; with on_error="warn" the Checkpointer logs such a failure '
            "and trains on, and a restart resumes from the newest committed checkpoint"
        ) from root_cause(cause)

    def apply_commits(
        self, results: list[CommitResult], error: BaseException | None, step: int
    ) -> BaseException | None:
        """What the writer drained: each committed checkpoint is durable and the profiler learns what it
        cost; an error (of the checkpoint at ``step``) goes in the events and is returned."""
        for result in results:
            self.durable_step = self.committed = result.step
            self.profiler.record_persist(result.seconds, result.bytes)
            self.events.write(
                "commit",
                step=result.step,
                persist_s=result.seconds,
                bytes=result.bytes,
                bandwidth_gbps=result.bytes / result.seconds / 1e9,
                upload=result.upload,
            )
        if error is not None:
            self.events.write("error", step=step, message=str(error))
        return error


def root_cause(error: BaseException) -> BaseException:
    """What a :class:`PersistError` raised for ``error`` chains: the failure itself (an ``OSError``), not
    another ``PersistError`` that only wraps it on the way from the writer."""
    while isinstance(error, PersistError) and error.__cause__ is not None:
        error = error.__cause__
    return error


__all__ = ["Capture", "Saver"]
