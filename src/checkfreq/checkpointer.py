"""The object users hold: registers the training state, counts steps, and wires the pieces together.

The one place where the layers below meet: each public method reads as the sequence of calls it
makes, and every concern it calls lives in a module of its own (the cluster, the policy, the tiers,
the saver with its snapshot, writer and commit, the restore).
"""

from __future__ import annotations

import inspect
import logging
import os
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

from checkfreq.errors import CheckfreqError, InvalidArgumentError, UnknownObjectError, UsageError
from checkfreq.pipeline.capture.registered import Registered
from checkfreq.pipeline.capture.staging import check_gpu_staging
from checkfreq.pipeline.restore import Restorer
from checkfreq.pipeline.restore.apply import restored_state, source_of
from checkfreq.pipeline.retention.retainer import Retainer
from checkfreq.pipeline.save.commit import Committer
from checkfreq.pipeline.save.saver import Saver
from checkfreq.pipeline.save.shutdown import shutdown
from checkfreq.pipeline.save.taker import Taker
from checkfreq.pipeline.tiers.chosen import choose_tiers
from checkfreq.pipeline.tiers.roles import Tier
from checkfreq.policies import Policy, resolve
from checkfreq.policies.memory_cadence import MemoryCadence
from checkfreq.policies.profiler import Profiler
from checkfreq.policies.retention import Retention
from checkfreq.ranks.cluster import attach
from checkfreq.ranks.processes import started_at
from checkfreq.run.events import EventLog
from checkfreq.run.options import check_objects, check_option_types, check_registration
from checkfreq.run.rng import RNGState
from checkfreq.run.scores import Scores
from checkfreq.run.session import saved_buckets, seed_session
from checkfreq.run.signals import SignalTrap
from checkfreq.run.state import Stateful, apply_state, flatten, unclaimed, unclaimed_message
from checkfreq.run.step_order import StepOrder, stepped_optimizer
from checkfreq.run.tensors import objects_on_cuda
from checkfreq.run.timeline import Timeline
from checkfreq.storage import Store, open_stores

log = logging.getLogger("checkfreq")

RESERVED_NAMES = frozenset({"rng", "checkfreq"})


class Checkpointer:
    """Checkpoints the registered training state at iteration granularity and restores it exactly.

    Args:
        directory: where checkpoints go (created if missing; must be writable): a local path,
            an fsspec URL (``s3://bucket/run``, ``gs://...``, ``memory://...``; ``file://`` is a
            local path) or a :class:`~checkfreq.storage.Store`. See docs/storage.md. Under
            torch.distributed, one directory every rank sees, or one per node on a node-local
            disk (docs/distributed.md).
        policy: when to checkpoint: a :class:`~checkfreq.policies.Policy`, an int ``n``
            (every ``n`` steps) or ``"auto"`` (the default).
        keep: how many committed checkpoints to keep (the newest one is never deleted), or a
            :class:`~checkfreq.Retention` (``Retention(3, every=1000)`` also keeps every checkpoint whose step
            is a multiple of 1000, ``Retention(3, best=("val_loss", "min"), top=2)`` the two best: :meth:`log`).
        remote: a second, durable tier (URL, path or store): checkpoints are committed to the
            local ``directory`` first, then copied to ``remote`` in the background (each rank
            its own file); restore takes the newest valid checkpoint of either tier, each file
            from the local directory when it is there. ``close()`` uploads the newest checkpoint
            and waits for it.
        remote_keep: how many checkpoints to keep in ``remote``, or a Retention (default: ``keep``).
        rng: capture and restore the Python, NumPy, torch and CUDA random generators.
        on_error: ``"raise"`` re-raises a background persist failure at the next ``step()``;
            ``"warn"`` logs it and training goes on. A blocking :meth:`save` always raises.
        allow_pickle: store (and load) values JSON cannot hold by pickling them. Off by
            default: loading a pickle can execute code.
        persist_timeout: seconds any wait on the background writer may take before raising.
        failure_timeout: under torch.distributed, seconds a rank waits for another that gives no
            sign of life (its process died, its node vanished) before it raises
            :class:`~checkfreq.errors.PeerLostError`, naming that rank, so that torchrun can restart
            the job; a rank busy writing is alive. A process leaving on an error waits at most this
            long for its background threads. See docs/reliability.md.
        save_on_signal: signals (e.g. ``(signal.SIGTERM,)``) that mean "preempted": the handler
            only records the signal; the next :meth:`step` (or :meth:`close`) takes a blocking
            checkpoint and then lets the signal take its original effect (the default action
            ends the process). Needs the main thread.
        memory: the memory tier (docs/storage.md): every snapshot lands in a shared-memory
            region under /dev/shm that outlives the process, and :meth:`restore` takes the newest
            valid state of memory and disk. ``True`` takes memory snapshots as often as the
            overhead bound allows (every step when the copy is cheap), an int ``n`` every ``n``
            steps; the policy still decides when to persist to disk. Falls back to disk only,
            with one warning, when /dev/shm has no room. Under torch.distributed with several
            ranks it must be a number of steps (every rank snapshots the same steps).
        replicas: with ``memory``, copy each memory snapshot to a rank on this many other machines (docs/storage.md).
        replica_stride: machine ``i`` copies to machines ``i + replica_stride``, ``i + 2 * replica_stride``, ...
        gpu_staging: CUDA state only: copy each snapshot into a reused device buffer first (a
            device-to-device copy the next optimizer step waits for), then to the host in the
            background. ``None`` (the default) does when the state fits in half of the free device
            memory at the first snapshot; ``True``/``False`` always/never (docs/performance.md).
        tiers: tiers of your own, after checkfreq's (docs/architecture.md, "A tier of your own"): each a
            :class:`~checkfreq.pipeline.tiers.roles.Tier` playing one role or more (a ``CommitFollower`` is
            handed each committed checkpoint, a ``CheckpointSource`` is read by :meth:`restore`).
            In a job of one process; refused under torch.distributed with several ranks.
        values: plain values to checkpoint, by name (numbers, strings, lists, dicts, tensors),
            readable and settable as ``ckpt[name]``; ``ckpt[name] = value`` registers more.
        **objects: what to checkpoint, by name: objects with ``state_dict()``/``load_state_dict()``
            (model, optimizer, scheduler, GradScaler, loader, ...).

    Raises:
        TypeError: a keyword is neither an option nor a stateful object (a misspelled option,
            named with the closest valid one, or a plain value, which belongs in ``values``), or
            an option has a value of the wrong type.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | Store,
        *,
        policy: Policy | str | int = "auto",
        keep: int | Retention = 3,
        remote: str | os.PathLike[str] | Store | None = None,
        remote_keep: int | Retention | None = None,
        rng: bool = True,
        on_error: str = "raise",
        allow_pickle: bool = False,
        persist_timeout: float = 3600.0,
        failure_timeout: float = 30.0,
        save_on_signal: Iterable[int] = (),
        memory: bool | int = False,
        replicas: int = 0,
        replica_stride: int = 1,
        gpu_staging: bool | None = None,
        tiers: Sequence[Tier] = (),
        values: Mapping[str, Any] | None = None,
        **objects: Stateful,
    ) -> None:
        check_objects("Checkpointer", objects, CHECKPOINTER_OPTIONS, option_types=(Policy,))
        check_option_types(
            keep=keep,
            remote_keep=remote_keep,
            rng=rng,
            allow_pickle=allow_pickle,
            persist_timeout=persist_timeout,
            failure_timeout=failure_timeout,
        )
        if on_error not in ("raise", "warn"):
            raise InvalidArgumentError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
        values = dict(values or {})
        check_registration(objects, values, RESERVED_NAMES)
        self._policy = resolve(policy)
        memory_cadence, gpu_staging = MemoryCadence.for_option(memory), check_gpu_staging(gpu_staging)
        self._trap = SignalTrap(save_on_signal) if save_on_signal else None
        self._on_error, self._allow_pickle, self._timeout = on_error, allow_pickle, persist_timeout
        self._objects: dict[str, Stateful] = dict(objects)
        self._values: dict[str, Any] = values
        self._unclaimed: list[str] = []  # what the restored checkpoint held that nothing registered took
        flatten(self._values, allow_pickle=allow_pickle)  # fail now on values we could never store
        if rng:
            self._objects["rng"] = RNGState()
        retention = Retention.of(keep)
        self._registered = Registered(self._objects, self._values, allow_pickle=allow_pickle, scores=Scores(retention))

        local, far = open_stores(directory, remote)
        # a cluster at every world size (a world of one alone)
        cluster = self._cluster = attach(local, far, persist_timeout, self._policy, failure_timeout)
        control = self._control = cluster.control
        self.directory = local.root
        retainer = Retainer(local, retention, leader=cluster.leader, directory=cluster.directory_leader)
        chosen = self._tiers = choose_tiers(
            local,
            far,
            cluster,
            memory=memory_cadence,
            replicas=replicas,
            replica_stride=replica_stride,
            failure_timeout=failure_timeout,
            retainer=retainer,
            far_retention=retention if remote_keep is None else Retention.of(remote_keep),
            own=tiers,
        )
        self._restorer = Restorer(
            chosen,
            control,
            page_cache=cluster.page_cache,
            directory_leader=cluster.directory_leader,
            retention=retention,
        )
        committer = Committer(
            local,
            cluster.commit,
            leader=retainer.leader,
            token=cluster.token,
            retainer=retainer,
            followers=chosen.followers,
            directory_leader=cluster.directory_leader,
        )
        self._closed = False
        self._events = EventLog(local.events_directory, rank=control.rank)
        self._events.write(
            "start",
            pid=os.getpid(),
            process_started=started_at(),
            policy=type(self._policy).__name__,
            keep=retention.keep,
            keep_every=retention.every,
        )
        self._saver = Saver(
            chosen,
            cluster,
            committer,
            self._events,
            self._objects,
            gpu_staging=gpu_staging,
            timeout=persist_timeout,
            on_error=on_error,
            policy_name=type(self._policy).__name__,
        )
        self._leaving: list[BaseException] = []  # the error a ``with`` block ends on
        self._finalizer = weakref.finalize(
            self,
            shutdown,
            self._saver.writer,
            chosen,
            timeout=persist_timeout,
            failure_timeout=failure_timeout,
            trap=self._trap,
            cluster=self._cluster,
            leaving=self._leaving,
        )
        if self._trap is not None:
            self._trap.install()

        self._optimizers = self._registered.optimizers
        self_ref = weakref.ref(self)
        self._hook_handles = [
            stepped_optimizer(opt).register_step_pre_hook(lambda *_: _fence_hook(self_ref))
            for opt in self._optimizers.values()
        ]
        self._step_order = StepOrder(
            [stepped_optimizer(opt) for opt in self._optimizers.values()], list(self._objects.values())
        )
        self._taker = Taker(
            self._objects,
            self._registered,
            self._saver,
            chosen,
            cluster,
            self._policy,
            self._trap,
            self.directory,
            foreign_step=self._restorer.newest_on_any_rank(),  # until restore() adopts them
        )

    # ------------------------------------------------------------------ user API

    @property
    def global_step(self) -> int:
        """Optimizer steps counted by :meth:`step` (restored by :meth:`restore`)."""
        return self._timeline.step

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def profiler(self) -> Profiler:
        return self._saver.profiler

    @property
    def _timeline(self) -> Timeline:
        return self._saver.timeline

    def __getitem__(self, name: str) -> Any:
        if name not in self._values and name in self._unclaimed:
            raise KeyError(f"{name!r} is not registered: {unclaimed_message('the restored checkpoint', [name])}")
        return self._values[name]

    def __setitem__(self, name: str, value: Any) -> None:
        if name in self._objects or name in RESERVED_NAMES:
            raise UnknownObjectError(f"{name!r} is a registered object, not a plain value")
        if name in self._unclaimed and name not in self._values:
            raise UsageError(
                f"{name!r} is registered after restore(), which would lose its restored value: "
                + unclaimed_message("the restored checkpoint", [name])
            )
        flatten({name: value}, allow_pickle=self._allow_pickle)
        self._values[name] = value

    def step(self, loss: float | None = None) -> bool:
        """Call once after each optimizer step; returns True if a checkpoint of this step was decided.

        It is captured at the step's consistent point: when the loop asks a registered loader for its
        next batch, a registered module runs its next training forward, or at ``save()``/``wait()``/
        ``close()``, whatever the loop did after the optimizer step included (docs/exactness.md).
        ``loss`` (optional) feeds convergence-aware policies. Re-raises a background persist
        failure (unless ``on_error="warn"``).
        """
        now = time.perf_counter()
        self._check_open("step()")
        self._tiers.going_on()
        self._step_order.check(self._timeline.step + 1)
        return self._taker.decide(now, loss)

    def save(self, blocking: bool = False) -> None:
        """Checkpoint the current state now, whatever the policy says.

        A checkpoint already taken at this step is taken again when anything registered changed
        since (an epoch-level scheduler, an evaluation, a value): the newer one replaces it, under
        the same step. With ``blocking=True``, returns only when the checkpoint is durable (and raises if it failed).
        """
        self._check_open("save()")
        self._tiers.going_on()
        self._saver.collect()
        taker = self._taker
        taker.at_point("save()")
        if blocking:
            taker.ensure_durable("save()", self._timeout)
        elif not taker.holds_current_state():
            taker.checkpoint(blocking=False, reason="save()")

    def log(self, **metrics: float) -> None:
        """Record metrics of the current step (``ckpt.log(val_loss=0.41)`` after an evaluation): the one
        ``Retention(best=...)`` ranks by scores a checkpoint of this step, decided now if none was, and
        captured, like every checkpoint, at the step's consistent point (docs/storage.md, "Keeping the best")."""
        self._check_open("log()")
        self._tiers.going_on()
        step = self._timeline.step
        if not self._registered.scores.log(step, metrics):
            return
        if self._taker.point.logged(step, metrics, self._registered):
            self._taker.at_point("log()")

    def consistent_point(self) -> None:
        """Capture now what this step decided: for a framework's integration, which knows where its loop's step
        ends (docs/exactness.md, "The consistent point"); a plain loop never needs it."""
        self._check_open("consistent_point()")
        self._taker.at_point("consistent_point()")

    def wait(self, timeout: float | None = None, *, remote: bool = False) -> None:
        """Block until the checkpoint in flight is durable (and the memory snapshot in flight
        committed); raise its error if it failed.

        With ``remote=True`` (and a remote tier), also until the newest checkpoint committed is
        in the remote tier, copying it now if a busy uploader skipped it. Under torch.distributed
        every rank must then call it at the same step. A checkpoint decided at this step and not yet
        captured (docs/exactness.md) is captured first: ``wait()`` is a consistent point.
        """
        timeout = self._timeout if timeout is None else timeout
        self._taker.at_point("wait()")
        self._saver.wait(timeout)
        if remote:
            self._tiers.flush(self._saver.newest_committed, timeout)

    def restore(self, step: int | str | None = None) -> int:
        """Load the newest valid checkpoint (or the one at ``step``; ``"best"``: the best scored) into the objects.

        Returns the restored step, or 0 when the directory holds no checkpoint (a fresh run). Invalid checkpoints
        are skipped with a warning saying why; if checkpoints exist but none is valid (or, for ``"best"``, none
        has a score), raises :class:`~checkfreq.errors.NoValidCheckpointError`. Training on from a step older
        than the newest sets the newer checkpoints aside: a later restore never takes that course again.
        """
        self._check_open("restore()")
        self._taker.point.take()  # what this run decided is not for the state restored
        self._saver.wait(self._timeout)
        start = time.perf_counter()
        found = self._restorer.find(
            step,
            blocks=lambda manifest: self._cluster.blocks(manifest, self._objects),
            device_copies=objects_on_cuda(self._objects.values()),
        )
        if found is None:
            self._taker.foreign_step = None
            return 0
        manifest = found.manifest
        state = restored_state(found, self._cluster, self._objects, allow_pickle=self._allow_pickle)
        source = source_of(found, self.directory)
        apply_state(self._objects, self._values, state, source, os.path.join(self.directory, found.name))
        self._unclaimed = unclaimed(state, self._objects, self._values, RESERVED_NAMES)
        if self._unclaimed:
            log.warning("%s", unclaimed_message(source, self._unclaimed))
        self._taker.replay_buckets(saved_buckets(state.get("checkfreq")))
        self._begin_session(manifest.step)
        self._saver.durable_step = -1 if found.held else manifest.step  # a state a tier holds is not on disk
        self._taker.foreign_step = None  # this run continues them
        self._tiers.went_back_to(manifest.step)
        self._saver.profiler, seeded = seed_session(state.get("checkfreq"), self._policy)
        seconds = time.perf_counter() - start
        self._events.write(
            "restore",
            step=manifest.step,
            skipped=found.skipped,
            tier=found.tier,
            seeded=seeded,
            world_size=self._cluster.world_size,
            saved_world_size=manifest.world_size,
            restore_s=seconds,
        )
        log.info("restored %s (step %d, %s tier) in %.2f s", found.name, manifest.step, found.tier, seconds)
        return manifest.step

    def start_at(self, step: int) -> None:
        """Count steps from ``step``: the registered state was loaded from elsewhere (a framework's
        own checkpoint), so the next :meth:`step` counts ``step + 1`` and checkpoints carry the
        step the training loop knows.

        Raises :class:`~checkfreq.errors.ExistingCheckpointsError` now if the directory holds
        checkpoints this run did not restore (rather than at the first checkpoint).
        """
        self._check_open("start_at()")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidArgumentError(f"start_at() takes a step >= 0, got {step!r}")
        self._taker.check_not_foreign()
        self._begin_session(step)
        self._events.write("start_at", step=step)

    def close(self) -> None:
        """Take a checkpoint waiting for its consistent point, wait for the one in flight, stop (idempotent)."""
        taker = self._taker
        taker.at_point("close()")
        self._closed = True
        if self._trap is not None and self._trap.received is not None:
            try:
                taker.save_for_signal(self._timeout)
            finally:
                self._finalizer()
        self._detach()
        if not self._cluster.writes_whole_state:
            taker.persist_newest_state()
        self._cluster.close()
        try:
            self.wait()
            self._saver.close_tiers(remove=taker.foreign_step is None)  # never another run's snapshots
        finally:
            self._finalizer()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            self._taker.point.drop(exc)  # the step's work may be half done
        if exc is not None and self._cluster.others_wait:  # leave within failure_timeout: no rank waits for it
            self._closed = True
            self._detach()
            self._leaving.append(exc)
            self._finalizer()
            return
        self.close()

    # ------------------------------------------------------------------ internals

    def _begin_session(self, step: int) -> None:
        """The registered state is now that of ``step`` (restored, or loaded from elsewhere)."""
        self._taker.point.take()  # what this run decided is not for that state
        self._saver.timeline = Timeline.restored(step)
        self._step_order.begin_session()
        self._registered.forget()
        self._tiers.taken(step)

    def _detach(self) -> None:
        """Take the hooks off the optimizers and forget the fence: nothing waits for this Checkpointer."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        self._step_order.close()
        self._taker.point.close()
        self._taker.closed = True
        self._saver.fence.clear()

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise UsageError(f"{call} on a closed Checkpointer; create a new one to go on checkpointing")


def _fence_hook(ref: weakref.ref[Checkpointer]) -> None:
    """Before a registered optimizer's update: the last consistent point of the step before it, then the fence."""
    checkpointer = ref()
    if checkpointer is not None:
        checkpointer._taker.at_point("optimizer.step()")
        checkpointer._saver.finish_fence()


CHECKPOINTER_OPTIONS = tuple(
    name
    for name, p in inspect.signature(Checkpointer.__init__).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
)
"""The option keywords of :class:`Checkpointer` (every other keyword registers an object)."""


__all__ = ["Checkpointer", "CheckfreqError"]
