"""The object users hold: registers the training state, counts steps, and wires the pieces together."""

from __future__ import annotations

import inspect
import logging
import os
import platform
import time
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

import checkfreq
from checkfreq.distributed import Cluster, attach
from checkfreq.distributed_plan import is_dtensor, local_view, source_rank, storage_ptr
from checkfreq.errors import (
    CheckfreqError,
    CorruptCheckpointError,
    ExistingCheckpointsError,
    NoValidCheckpointError,
    PersistError,
    ReplicaMismatchError,
    StateMismatchError,
)
from checkfreq.events import EventLog
from checkfreq import storage
from checkfreq.options import check_objects, check_option_types
from checkfreq.format import Manifest, encode_header, entry_view, tensor_entries
from checkfreq.memory_cadence import MemoryCadence
from checkfreq.memory_tier import MemoryState, MemoryTier
from checkfreq.persist import Writer
from checkfreq.policies import DecisionContext, Policy, StatefulPolicy, resolve
from checkfreq.profiler import Profiler
from checkfreq.retention import Retention
from checkfreq.rng import RNGState
from checkfreq.signals import SignalTrap
from checkfreq.snapshot import PendingSnapshot, Snapshotter, layout_of
from checkfreq.state import Stateful, check_fits, flatten, load_into, own_storage, type_name, unflatten
from checkfreq.storage import Store
from checkfreq.storage.local import LocalStore
from checkfreq.storage.shm import remove_regions_beyond

log = logging.getLogger("checkfreq")

RESERVED_NAMES = frozenset({"rng", "checkfreq"})
DATA_FILE = "rank00000.safetensors"


class Checkpointer:
    """Checkpoints the registered training state at iteration granularity and restores it exactly.

    Args:
        directory: where checkpoints go (created if missing; must be writable): a local path,
            an fsspec URL (``s3://bucket/run``, ``gs://...``, ``memory://...``; ``file://`` is a
            local path) or a :class:`~checkfreq.storage.Store`. See docs/storage.md.
        policy: when to checkpoint: a :class:`~checkfreq.policies.Policy`, an int ``n``
            (every ``n`` steps) or ``"auto"`` (the default).
        keep: how many committed checkpoints to keep (the newest one is never deleted).
        remote: a second, durable tier (URL, path or store): checkpoints are committed to the
            local ``directory`` first, then copied to ``remote`` in the background; restore
            takes the newest valid checkpoint of either tier. ``close()`` waits for the uploads.
        remote_keep: how many checkpoints to keep in ``remote`` (default: ``keep``).
        rng: capture and restore the Python, NumPy, torch and CUDA random generators.
        on_error: ``"raise"`` re-raises a background persist failure at the next ``step()``;
            ``"warn"`` logs it and training goes on. A blocking :meth:`save` always raises.
        allow_pickle: store (and load) values JSON cannot hold by pickling them. Off by
            default: loading a pickle can execute code.
        persist_timeout: seconds any wait on the background writer may take before raising.
        save_on_signal: signals (e.g. ``(signal.SIGTERM,)``) that mean "preempted": the handler
            only records the signal; the next :meth:`step` (or :meth:`close`) takes a blocking
            checkpoint and then lets the signal take its original effect (the default action
            ends the process). Needs the main thread.
        memory: the memory tier (docs/storage.md): every snapshot lands in a shared-memory
            region under /dev/shm that outlives the process, and :meth:`restore` takes the newest
            valid state of memory and disk. ``True`` takes memory snapshots as often as the
            overhead bound allows (every step when the copy is cheap), an int ``n`` every ``n``
            steps; the policy still decides when to persist to disk. Falls back to disk only,
            with one warning, when /dev/shm has no room. Under torch.distributed it must be a
            number of steps (every rank snapshots the same steps).
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
        keep: int = 3,
        remote: str | os.PathLike[str] | Store | None = None,
        remote_keep: int | None = None,
        rng: bool = True,
        on_error: str = "raise",
        allow_pickle: bool = False,
        persist_timeout: float = 3600.0,
        save_on_signal: Iterable[int] = (),
        memory: bool | int = False,
        values: Mapping[str, Any] | None = None,
        **objects: Stateful,
    ) -> None:
        check_objects("Checkpointer", objects, CHECKPOINTER_OPTIONS, option_types=(Policy,))
        check_option_types(keep=keep, remote_keep=remote_keep, rng=rng, allow_pickle=allow_pickle, persist_timeout=persist_timeout)
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
        values = dict(values or {})
        if not objects and not values:
            raise ValueError("register at least one object to checkpoint, e.g. Checkpointer(dir, model=model)")
        for name in [*objects, *values]:
            if name in RESERVED_NAMES:
                raise ValueError(f"{name!r} is reserved by checkfreq; register it under another name")
        for name, obj in objects.items():
            _refuse_positionless_loader(name, obj)
        both = sorted(set(objects) & set(values))
        if both:
            raise ValueError(f"{', '.join(map(repr, both))} registered both as an object and in values=")
        self._policy = resolve(policy)
        memory_cadence = _memory_cadence(memory)
        self._trap = SignalTrap(save_on_signal) if save_on_signal else None
        self._retention = Retention(keep)
        self._on_error = on_error
        self._allow_pickle = allow_pickle
        self._timeout = persist_timeout
        self._objects: dict[str, Stateful] = dict(objects)
        self._values: dict[str, Any] = values
        flatten(self._values, allow_pickle=allow_pickle)  # fail now on values we could never store
        self._epoch_source = next((o for o in self._objects.values() if _has_int_epoch(o)), None)
        if rng:
            self._objects["rng"] = RNGState()

        self._store = storage.open_store(directory, remote=remote, remote_keep=keep if remote_keep is None else remote_keep)
        if not isinstance(self._store, LocalStore) and torch.distributed.is_available() and torch.distributed.is_initialized():
            raise ValueError("under torch.distributed, checkpoints go to a shared local directory; remote stores are single-process")
        self._store.check_writable()
        self._cluster: Cluster | None = attach(self._store, persist_timeout)  # under torch.distributed
        if self._cluster is None:
            self._store.lock()
            self._store.remove_staging()
        self._decide = self._policy.should_save if self._cluster is None else self._cluster.decider(self._policy)
        self.directory = self._store.root
        self._memory = None if memory_cadence is None else self._open_memory_tier(memory_cadence)
        newest = [s for s, _ in self._store.checkpoints()[:1]]
        if self._memory is not None and self._cluster is None:  # ranks must agree: disk decides for them
            newest += [s for s in [self._memory.newest_step()] if s is not None]
        self._foreign_step: int | None = max(newest, default=None)  # until restore() adopts them
        self._closed = False
        self._events = EventLog(self._store.events_directory, rank=0 if self._cluster is None else self._cluster.rank)
        self._events.write("start", pid=os.getpid(), policy=type(self._policy).__name__, keep=keep)
        self._profiler = Profiler()
        self._snapshotter = Snapshotter()
        self._writer = Writer()
        self._finalizer = weakref.finalize(self, _shutdown, self._writer, self._store, persist_timeout, self._trap)
        if self._trap is not None:
            self._trap.install()

        self._optimizers = {n: o for n, o in self._objects.items() if isinstance(o, torch.optim.Optimizer)}
        self_ref = weakref.ref(self)
        self._hook_handles = [
            _stepped_optimizer(opt).register_step_pre_hook(lambda *_: _fence_hook(self_ref))
            for opt in self._optimizers.values()
        ]
        self._fence: PendingSnapshot | None = None
        self._fence_stall = 0.0
        self._fence_memory = False  # the fenced snapshot is a memory-only one

        self._global_step = 0
        self._session_start_step = 0  # the global step this session started from (its restore)
        self._last_checkpoint_step = 0
        self._durable_step = -1  # the newest step known committed (set by the writer)
        self._started = time.perf_counter()
        self._last_step_time: float | None = None
        self._transitions_seen = 0  # the writer's job transitions at the previous step()
        self._clean_count, self._clean_seconds = 0, 0.0  # this window's iterations without a stall or persist
        self._last_checkpoint_time = self._started
        self._last_epoch: int | None = None

    # ------------------------------------------------------------------ user API

    @property
    def global_step(self) -> int:
        """Optimizer steps counted by :meth:`step` (restored by :meth:`restore`)."""
        return self._global_step

    @property
    def _world_size(self) -> int:
        return 1 if self._cluster is None else self._cluster.world_size

    @property
    def policy(self) -> Policy:
        return self._policy

    @property
    def profiler(self) -> Profiler:
        return self._profiler

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __setitem__(self, name: str, value: Any) -> None:
        if name in self._objects or name in RESERVED_NAMES:
            raise KeyError(f"{name!r} is a registered object, not a plain value")
        flatten({name: value}, allow_pickle=self._allow_pickle)
        self._values[name] = value

    def step(self, loss: float | None = None) -> bool:
        """Call once after each optimizer step; returns True if a checkpoint was started.

        ``loss`` (optional) feeds convergence-aware policies. Re-raises a background persist
        failure (unless ``on_error="warn"``).
        """
        now = time.perf_counter()
        self._check_open("step()")
        self._surface_background_error()
        self._global_step += 1
        transitions = self._writer.transitions
        if self._last_step_time is not None:
            seconds = now - self._last_step_time
            # persisting: a persist overlapped any part of this iteration, even one that ended within it
            persisting = self._writer.busy or transitions != self._transitions_seen
            self._profiler.record_iteration(seconds, persisting=persisting)
            if not persisting and self._global_step - self._last_checkpoint_step > 1:  # the first one holds the stall
                self._clean_count, self._clean_seconds = self._clean_count + 1, self._clean_seconds + seconds
        self._last_step_time, self._transitions_seen = now, transitions
        if self._trap is not None and self._trap.received is not None:
            self._save_for_signal()
        ctx = self._context(now, loss)
        if self._decide(ctx):
            self._checkpoint(blocking=False, reason="policy")
            return True
        if self._memory is not None and self._memory.enabled and self._memory.cadence.due(self._global_step, ctx.iteration_time):
            self._snapshot_to_memory()
        return False

    def save(self, blocking: bool = False) -> None:
        """Checkpoint the current state now, whatever the policy says.

        With ``blocking=True``, returns only when the checkpoint is durable (and raises if it failed).
        """
        self._check_open("save()")
        self._surface_background_error()
        if blocking:
            self._ensure_durable("save()")
        elif self._last_checkpoint_step != self._global_step or self._global_step == 0:
            self._checkpoint(blocking=False, reason="save()")

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint in flight is durable (and the memory snapshot in flight
        committed); raise its error if it failed."""
        self._writer.wait(self._timeout if timeout is None else timeout)
        self._surface_background_error()
        if self._memory is not None:
            self._wait_memory()

    def restore(self, step: int | None = None) -> int:
        """Load the newest valid checkpoint (or the one at ``step``) into the registered objects.

        Returns the restored step, or 0 when the directory holds no checkpoint (a fresh run).
        Invalid checkpoints are skipped with a warning saying why; if checkpoints exist but none
        is valid, raises :class:`~checkfreq.errors.NoValidCheckpointError`.
        """
        self._check_open("restore()")
        self.wait()
        if self._cluster is None:
            found = self._find_across_tiers(step)
        else:  # every rank restores the same step: from memory if all hold it, else rank 0 picks from disk
            found = None if self._memory is None else self._agreed_memory_state(step)
            if found is None:
                found = self._cluster.find(lambda: self._find(step), read_checkpoint)
        if found is None:
            self._foreign_step = None
            return 0
        manifest, tensors, path, skipped = found
        from_memory = isinstance(path, MemoryState)
        if not from_memory:  # a memory snapshot is this rank's whole state, taken by this very job
            self._note_world_size_change(manifest)
        if from_memory or self._cluster is None:
            skeleton, tensors = local_view(manifest, tensors)
        else:
            skeleton, tensors = self._cluster.view(manifest, tensors, self._objects)
        state = unflatten(skeleton, tensors, allow_pickle=self._allow_pickle)
        self._apply(state)
        self._global_step = self._last_checkpoint_step = self._session_start_step = manifest.step
        self._durable_step = -1 if from_memory else manifest.step  # a memory snapshot is not on disk
        self._foreign_step = None  # this run continues them
        self._last_step_time = None
        self._clean_count, self._clean_seconds = 0, 0.0
        self._started = self._last_checkpoint_time = time.perf_counter()
        if self._memory is not None:
            self._memory.forget_newer_than(manifest.step)
            self._memory.cadence.taken(manifest.step)
        seeded = self._seed_session(state.get("checkfreq"))
        tier = "memory" if from_memory else getattr(path, "tier", "local")
        self._events.write("restore", step=manifest.step, skipped=skipped, tier=tier, seeded=seeded,
                           world_size=self._world_size, saved_world_size=manifest.world_size)
        log.info("restored %s (step %d, %s tier)", path.name, manifest.step, tier)
        return manifest.step

    def _note_world_size_change(self, manifest: Manifest) -> None:
        """Say whose per-rank state this rank takes when the checkpoint was written by another number of ranks."""
        rank, world = (0 if self._cluster is None else self._cluster.rank), self._world_size
        if manifest.world_size == world:
            return
        dropped = ""
        if world < manifest.world_size and rank == 0:
            dropped = f"; the per-rank state of saved ranks {world}..{manifest.world_size - 1} is not restored"
        log.warning(
            "checkpoint at step %d was written by %d rank(s), this job has %d: rank %d restores the per-rank state "
            "(buffers, plain values, random generators) of saved rank %d and the parameters and optimizer state "
            "every rank shared%s (docs/distributed.md)",
            manifest.step, manifest.world_size, world, rank, source_rank(rank, manifest.world_size), dropped,
        )

    def _agreed_memory_state(self, step: int | None) -> tuple[Manifest, dict[str, torch.Tensor], Any, list[tuple[str, str]]] | None:
        """Under torch.distributed: the memory snapshot of the newest step all ranks hold, unless disk is newer."""
        listed = [s for s, _ in self._store.checkpoints() if step is None or s == step]
        state, skipped = self._memory.agree(step, listed[0] if listed else None, self._cluster.control_group)  # type: ignore[union-attr]
        if state is None:
            if skipped:
                log.warning("memory tier: not every rank holds a newer valid snapshot; restoring from disk")
            return None
        return state.manifest, state.tensors, state, skipped

    def _find_across_tiers(self, step: int | None) -> tuple[Manifest, dict[str, torch.Tensor], Any, list[tuple[str, str]]] | None:
        """The newest valid state of the memory tier and the store (or the one at ``step``);
        memory wins a tie (it reads fastest), disk the rest, memory again if no disk checkpoint is valid."""
        if self._memory is None:
            return self._find(step)
        state, skipped = self._memory.read(step)
        if state is not None:
            listed = [s for s, _ in self._store.checkpoints() if step is None or s == step]
            if not listed or state.manifest.step >= listed[0]:
                return state.manifest, state.tensors, state, skipped
        try:
            found = self._find(step)
        except NoValidCheckpointError:
            if state is None:
                raise
            found = None
        if found is None:
            return None if state is None else (state.manifest, state.tensors, state, skipped)
        manifest, tensors, path, disk_skipped = found
        return manifest, tensors, path, skipped + disk_skipped

    def _find(self, step: int | None) -> tuple[Manifest, dict[str, torch.Tensor], Path, list[tuple[str, str]]] | None:
        """The newest valid checkpoint (or the one at ``step``) as (manifest, arrays, path, skipped)."""
        candidates = [(s, p) for s, p in self._store.checkpoints() if step is None or s == step]
        if not candidates:
            if step is not None:
                raise NoValidCheckpointError(f"no checkpoint for step {step} in {self.directory}")
            return None
        skipped: list[tuple[str, str]] = []
        for _, path in candidates:
            try:
                manifest, tensors = read_checkpoint(path, self._store)
                return manifest, tensors, path, skipped
            except CorruptCheckpointError as e:
                log.warning("skipping checkpoint %s: %s", path.name, e)
                skipped.append((path.name, str(e)))
        reasons = "; ".join(f"{name}: {why}" for name, why in skipped)
        raise NoValidCheckpointError(f"no valid checkpoint in {self.directory} ({reasons})")

    def close(self) -> None:
        """Wait for the checkpoint in flight, stop the writer and release the directory (idempotent)."""
        self._closed = True
        if self._trap is not None and self._trap.received is not None:
            try:
                self._save_for_signal()
            finally:
                self._finalizer()
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        self._fence = None
        if self._cluster is not None:
            if self._memory is not None:
                self._persist_newest_state()
            self._cluster.close()
        try:
            self.wait()
            if self._memory is not None:
                self._close_memory_tier()
        finally:
            self._finalizer()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _context(self, now: float, loss: float | None) -> DecisionContext:
        epoch = self._epoch()
        changed = self._last_epoch is not None and epoch != self._last_epoch
        self._last_epoch = epoch
        p = self._profiler
        return DecisionContext(
            step=self._global_step,
            session_steps=self._global_step - self._session_start_step,
            steps_since_checkpoint=self._global_step - self._last_checkpoint_step,
            elapsed=now - self._started,
            seconds_since_checkpoint=now - self._last_checkpoint_time,
            iteration_time=p.iteration.value,
            iteration_time_while_persisting=p.iteration_while_persisting.value,
            stall=p.stall.value,
            persist_time=p.persist.value,
            checkpoint_cost=p.checkpoint_cost.value,
            bytes_per_checkpoint=p.bytes_per_checkpoint,
            persist_in_flight=self._writer.busy,
            epoch=epoch,
            epoch_changed=changed,
            loss=loss,
        )

    def _run_state(self, step: int) -> dict[str, Any]:
        """The reserved ``checkfreq`` entry of a checkpoint (plain JSON): the step, the optimizers'
        classes (checked on restore) and what the run has learned."""
        state: dict[str, Any] = {
            "global_step": step,
            "optimizer_types": {name: type_name(opt) for name, opt in self._optimizers.items()},
            "profile": self._profiler.state_dict(),
        }
        if isinstance(self._policy, StatefulPolicy):
            state["policy"] = {"type": type(self._policy).__name__, "state": self._policy.state_dict()}
        return state

    def _seed_session(self, saved: Any) -> list[str]:
        """Start the restored session from what the checkpoint's run had learned; returns what was seeded.

        The profiler starts afresh, seeded with the saved estimates, and the policy resumes its
        saved state; both are re-validated by this session's measurements. A state that does not
        fit (an older checkpoint, another policy or configuration) is left out with a warning:
        the session then profiles from scratch, which is slower to settle but never wrong.
        """
        self._profiler = Profiler()
        saved = saved if isinstance(saved, dict) else {}
        seeded = []
        if "profile" in saved:
            try:
                self._profiler.load_state_dict(saved["profile"])
                seeded.append("profile")
            except (ValueError, TypeError, AttributeError) as e:
                log.warning("not resuming the saved profile (%s); this session profiles afresh", e)
        policy = saved.get("policy")
        if isinstance(self._policy, StatefulPolicy) and policy is not None:
            name = type(self._policy).__name__
            try:
                if not isinstance(policy, dict) or policy.get("type") != name:
                    saved_type = policy.get("type") if isinstance(policy, dict) else policy
                    raise ValueError(f"it was saved by policy {saved_type!r}, this run uses {name}")
                self._policy.load_state_dict(policy["state"])
                seeded.append("policy")
            except (ValueError, TypeError, KeyError, AttributeError) as e:
                log.warning("not resuming the saved state of the %s policy (%s); it plans afresh from this session's measurements", name, e)
        return seeded

    def _epoch(self) -> int | None:
        """The epoch of the first registered object that has one (the loader), found once."""
        if self._epoch_source is None:
            return None
        epoch = getattr(self._epoch_source, "epoch", None)
        return epoch if isinstance(epoch, int) else None

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise CheckfreqError(f"{call} on a closed Checkpointer; create a new one to go on checkpointing")

    def _surface_background_error(self) -> None:
        error = self._writer.take_error()
        if error is None:
            return
        if isinstance(error, ReplicaMismatchError):  # the training state is wrong, not the storage: always raised
            raise error
        if self._on_error == "warn":
            log.warning("checkpoint persist failed, training goes on: %s", error)
            return
        raise PersistError(f"checkpoint persist failed: {error}") from error

    def _check_not_foreign(self) -> None:
        """Refuse to checkpoint over checkpoints (or memory snapshots) this run did not restore."""
        if self._foreign_step is not None:
            raise ExistingCheckpointsError(
                f"{self.directory} already holds checkpoints (the newest at step {self._foreign_step}) and this run "
                "did not restore them: its checkpoints would be written beside and over them. Call restore() "
                "before training to resume from them (resume=True for CheckFreqCallback, "
                "resume_from_checkpoint=True for CheckFreqTrainer), or give this run a directory of its own."
            )

    def _checkpoint(self, *, blocking: bool, reason: str) -> None:
        self._check_not_foreign()
        start = time.perf_counter()
        self._writer.wait(self._timeout)  # the host buffer is reused: one checkpoint in flight
        self._surface_background_error()
        if self._memory is not None:
            self._wait_memory()
        self._finish_fence()
        step, epoch = self._global_step, self._epoch()
        skeleton, tensors, owned = self._capture(step)
        share = None
        if self._cluster is not None:  # this rank writes its share only
            tensors, owned, share = self._cluster.select(tensors, owned, self._replicated(tensors))
        self._profiler.begin_checkpoint()
        layout = layout_of(tensors)
        target = None
        if self._memory is not None and self._cluster is None:  # several ranks persist shares: their own buffer
            target = self._memory.target(layout, skeleton, step, epoch, _versions(), time.time())
        pending = self._snapshotter.take(tensors, owned, layout=layout, buffer=None if target is None else target.buffer)
        job = lambda: self._persist(pending, skeleton, step, epoch, start, share)  # noqa: E731
        if target is not None:
            job = self._memory.around_persist(target, pending, job)  # type: ignore[union-attr]
            self._memory.cadence.taken(step)  # type: ignore[union-attr]
        self._writer.submit(job)
        interval_steps, interval_s = step - self._last_checkpoint_step, start - self._last_checkpoint_time
        self._last_checkpoint_step = step
        self._last_checkpoint_time = start
        stall = time.perf_counter() - start
        self._events.write(
            "snapshot", step=step, stall_s=stall, bytes=pending.layout.nbytes, reason=reason,
            policy=type(self._policy).__name__, epoch=epoch, interval_steps=interval_steps, interval_s=interval_s,
            iteration_s=self._profiler.iteration.value,
            iteration_persisting_s=self._profiler.iteration_while_persisting.value,
            clean_iterations=self._clean_count,
            clean_iteration_s=self._clean_seconds / self._clean_count if self._clean_count else None,
        )
        self._clean_count, self._clean_seconds = 0, 0.0
        if pending.has_deferred:
            self._fence, self._fence_stall, self._fence_memory = pending, stall, False
        else:
            self._profiler.record_stall(stall)
        if blocking:
            self._writer.wait(self._timeout)
            self._finish_fence()
            error = self._writer.take_error()
            if isinstance(error, ReplicaMismatchError):
                raise error
            if error is not None:  # the caller waits for this very checkpoint: raise whatever on_error says
                raise PersistError(f"checkpoint at step {step} failed: {error}") from error

    def _capture(self, step: int) -> tuple[Any, dict[str, torch.Tensor], set[str]]:
        """The registered state as (skeleton, tensors, names of the optimizer-owned tensors)."""
        state: dict[str, Any] = {name: obj.state_dict() for name, obj in self._objects.items()}
        state.update(self._values)
        state["checkfreq"] = self._run_state(step)
        skeleton, tensors = flatten(state, allow_pickle=self._allow_pickle)
        return skeleton, tensors, self._optimizer_owned(tensors)

    # ------------------------------------------------------------------ memory tier

    def _open_memory_tier(self, cadence: MemoryCadence) -> MemoryTier:
        if self._cluster is None:
            return MemoryTier(self._store.root, cadence, data_file=DATA_FILE)
        if cadence.every is None:  # ranks measuring different costs would snapshot different steps
            raise ValueError("under torch.distributed, memory= takes a number of steps (e.g. memory=1), so that "
                             "every rank snapshots the same steps")
        if self._cluster.rank == 0:
            remove_regions_beyond(self._store.root, self._cluster.world_size)
        return MemoryTier(self._store.root, cadence, data_file=DATA_FILE, rank=self._cluster.rank)

    def _snapshot_to_memory(self) -> None:
        """Snapshot into the memory tier only (the disk policy did not ask for a persist)."""
        memory = self._memory
        assert memory is not None
        self._check_not_foreign()
        start = time.perf_counter()
        self._wait_memory()
        self._finish_fence()
        step, epoch = self._global_step, self._epoch()
        skeleton, tensors, owned = self._capture(step)
        if self._cluster is not None and any(is_dtensor(t) for t in tensors.values()):
            log.warning("memory tier off: it holds each rank's whole local state and does not take sharded (DTensor) state yet")
            memory.enabled = False
            return
        layout = layout_of(tensors)
        target = memory.target(layout, skeleton, step, epoch, _versions(), time.time())
        if target is None:
            return
        pending = self._snapshotter.take(tensors, owned, layout=layout, buffer=target.buffer)
        memory.submit(target, pending, skeleton, epoch)
        memory.cadence.taken(step)
        stall = time.perf_counter() - start
        self._events.write("memory", step=step, stall_s=stall, bytes=layout.nbytes)
        cost = stall - target.setup_s  # creating the region is a one-time cost
        if pending.has_deferred:
            self._fence, self._fence_stall, self._fence_memory = pending, cost, True
        else:
            memory.cadence.record(cost)

    def _wait_memory(self) -> None:
        """Wait for the memory snapshot being committed; a failed commit is reported like a persist error."""
        memory = self._memory
        assert memory is not None
        memory.writer.wait(self._timeout)
        error = memory.writer.take_error()
        if error is None:
            return
        memory.newest = None  # never committed: nothing to persist from it
        if self._on_error == "warn":
            log.warning("memory snapshot failed, training goes on: %s", error)
            return
        raise PersistError(f"memory snapshot failed: {error}") from error

    def _persist_newest_state(self) -> None:
        """Under torch.distributed, before a clean close removes the regions: a collective blocking
        checkpoint if the ranks' newest memory snapshot (the same step on every rank) is newer than disk."""
        self._wait_memory()
        newest = self._memory.newest  # type: ignore[union-attr]
        if newest is not None and newest.step == self._global_step and self._durable_step < self._global_step:
            self._checkpoint(blocking=True, reason="close")

    def _close_memory_tier(self) -> None:
        """Persist the newest memory snapshot if disk is behind it, then remove the region (a clean close)."""
        memory = self._memory
        assert memory is not None
        self._wait_memory()
        newest = memory.newest
        if newest is not None and newest.step > self._durable_step and self._cluster is None:
            start = time.perf_counter()
            self._events.write("snapshot", step=newest.step, stall_s=0.0, bytes=newest.pending.layout.nbytes, reason="close",
                               policy=type(self._policy).__name__, epoch=newest.epoch)
            self._writer.submit(lambda: self._persist(newest.pending, newest.skeleton, newest.step, newest.epoch, start))
            self._writer.wait(self._timeout)
            error = self._writer.take_error()
            if error is not None:
                memory.close(remove=False, timeout=self._timeout)  # the region keeps the newest state
                raise PersistError(f"persisting the newest memory snapshot (step {newest.step}) at close failed: {error}") from error
        memory.close(remove=self._foreign_step is None, timeout=self._timeout)  # never another run's snapshots

    def _optimizer_owned(self, tensors: dict[str, torch.Tensor]) -> set[str]:
        """Names of tensors only a registered optimizer's step changes: safe to copy behind a fence."""
        if not self._optimizers:
            return set()
        params = [p for opt in self._optimizers.values() for g in opt.param_groups for p in g["params"]]
        return self._state_of(tensors, params, self._optimizers)

    def _replicated(self, tensors: dict[str, torch.Tensor]) -> set[str]:
        """Names of tensors data parallelism keeps the same on every rank: parameters and optimizer state.

        The parameters of registered modules and optimizers and the optimizer state; buffers
        (BatchNorm statistics), plain values and other objects' tensors may differ between ranks.
        """
        modules = [o for o in self._objects.values() if isinstance(o, torch.nn.Module)]
        params = [p for m in modules for p in m.parameters()]
        params += [p for opt in self._optimizers.values() for g in opt.param_groups for p in g["params"]]
        return self._state_of(tensors, params, self._optimizers)

    @staticmethod
    def _state_of(tensors: dict[str, torch.Tensor], params: list[torch.Tensor], optimizers: dict[str, Any]) -> set[str]:
        """Names of ``tensors`` that are one of ``params`` or under an optimizer's ``state``."""
        param_ptrs = {storage_ptr(p) for p in params}
        prefixes = tuple(f"{name}/state/" for name in optimizers)
        return {n for n, t in tensors.items() if n.startswith(prefixes) or storage_ptr(t) in param_ptrs}

    def _finish_fence(self) -> None:
        """Wait until the deferred copies of the last snapshot are done (called before the state changes)."""
        pending, self._fence = self._fence, None
        if pending is None:
            return
        start = time.perf_counter()
        pending.order_after_copy()
        if pending.cpu_fence:
            pending.copy_pieces()  # share the copies the writer has not reached yet
            deadline = start + self._timeout
            while not pending.copied.wait(0.5):
                (self._memory.writer if self._fence_memory else self._writer).check_alive()  # type: ignore[union-attr]
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"snapshot copy still running after {self._timeout} s")
        wait = time.perf_counter() - start
        if self._fence_memory:
            self._memory.cadence.record(self._fence_stall + wait)  # type: ignore[union-attr]
            return
        self._profiler.record_stall(self._fence_stall + wait)
        self._events.write("fence", step=self._last_checkpoint_step, wait_s=wait, stall_s=self._fence_stall + wait)

    def _persist(
        self, pending: PendingSnapshot, skeleton: Any, step: int, epoch: int | None, start: float, share: dict[str, Any] | None = None
    ) -> None:
        if share is not None:
            self._persist_shared(pending, share, skeleton, step, epoch, start)
            return
        staging = None
        try:
            pending.finish_copy()
            staging = self._store.staging_dir(step)
            size, digest = storage.write_data(self._store, staging, DATA_FILE, encode_header(pending.layout), pending.buffer)
            manifest = Manifest(
                step=step,
                epoch=epoch,
                world_size=1,
                files={DATA_FILE: {"size": size, "xxh3_64": digest}},
                tensors=tensor_entries(pending.layout, DATA_FILE),
                state=skeleton,
                versions=_versions(),
                created=time.time(),
            )
            storage.write_manifest(self._store, staging, manifest)
            final = self._store.commit(staging, step)
        except BaseException as e:
            if staging is not None:
                self._store.discard(staging)
            self._events.write("error", step=step, message=str(e))
            raise
        finally:
            pending.copied.set()
        self._store.retain(self._retention, final)
        self._record_commit(step, size, start)

    def _persist_shared(self, pending: PendingSnapshot, share: dict[str, Any], skeleton: Any, step: int, epoch: int | None, start: float) -> None:
        """Several ranks: write this rank's file; rank 0 commits once every rank's file is durable."""
        try:
            final, size = self._cluster.persist(pending, share, skeleton, step, epoch, _versions())  # type: ignore[union-attr]
        except BaseException as e:
            self._events.write("error", step=step, message=str(e))
            raise
        if final is not None:
            self._store.retain(self._retention, final)
        self._record_commit(step, size, start)

    def _record_commit(self, step: int, size: int, start: float) -> None:
        self._durable_step = step
        seconds = time.perf_counter() - start
        self._profiler.record_persist(seconds, size)
        self._events.write("commit", step=step, persist_s=seconds, bytes=size, bandwidth_gbps=size / seconds / 1e9)

    def _apply(self, state: dict[str, Any]) -> None:
        missing = sorted(set(self._objects) - set(state) - {"rng"})
        if missing:
            raise StateMismatchError(f"checkpoint holds no state for {', '.join(missing)}")
        saved_types = (state.get("checkfreq") or {}).get("optimizer_types") or {}
        for name, obj in self._objects.items():  # every module and optimizer fits before any changes
            check_fits(name, obj, state.get(name), saved_types.get(name))
        for name, obj in self._objects.items():
            if name != "rng":
                load_into(name, obj, state[name])
        for name in self._values:
            if name in state:
                self._values[name] = own_storage(state[name])
        if "rng" in self._objects and "rng" in state:
            self._objects["rng"].load_state_dict(state["rng"])  # last: nothing above may draw after it

    def _ensure_durable(self, reason: str) -> None:
        """Make the state at the current step durable, reusing a checkpoint taken at this step if it committed."""
        if self._last_checkpoint_step == self._global_step and self._global_step != 0:
            self.wait()
            if self._durable_step == self._global_step:
                return
        self._checkpoint(blocking=True, reason=reason)

    def _save_for_signal(self) -> None:
        """Preempted: make the current state durable, then let the signal act as it would have."""
        signum = self._trap.received  # type: ignore[union-attr]
        self._events.write("signal", step=self._global_step, signal=signum)
        log.warning("signal %s received: taking a blocking checkpoint at step %d", signum, self._global_step)
        try:
            self._ensure_durable("signal")
        except BaseException:
            log.error("the checkpoint taken for signal %s failed", signum, exc_info=True)
            raise
        finally:
            self._trap.honour()  # type: ignore[union-attr]


def _memory_cadence(memory: bool | int) -> MemoryCadence | None:
    """The memory tier's cadence for the ``memory`` option (None: no memory tier)."""
    if memory is False:
        return None
    if memory is True:
        return MemoryCadence()
    if isinstance(memory, int) and not isinstance(memory, bool) and memory >= 1:
        return MemoryCadence(every=memory)
    raise TypeError(f"memory must be True, False or a positive number of steps, got {memory!r}")


def _has_int_epoch(obj: object) -> bool:
    epoch = getattr(obj, "epoch", None)
    return isinstance(epoch, int) and not isinstance(epoch, bool)


def _refuse_positionless_loader(name: str, obj: object) -> None:
    """Refuse an Accelerate-prepared DataLoader: it has ``state_dict()`` but no position to give."""
    if getattr(obj, "use_stateful_dataloader", None) is False:
        raise ValueError(
            f"{name!r} is a {type(obj).__name__} prepared by Accelerate, which cannot save its position; "
            "register a checkfreq.data.ResumableLoader (not passed to accelerator.prepare) instead"
        )


def _stepped_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer whose ``step()`` runs: a wrapper's (Accelerate's ``AcceleratedOptimizer``) inner one."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _fence_hook(ref: weakref.ref[Checkpointer]) -> None:
    checkpointer = ref()
    if checkpointer is not None:
        checkpointer._finish_fence()


def _shutdown(writer: Writer, store: Store, timeout: float, trap: SignalTrap | None) -> None:
    try:
        if trap is not None:
            trap.uninstall()
        writer.close(timeout)
    finally:
        store.unlock()


def _versions() -> dict[str, str]:
    return {"checkfreq": checkfreq.__version__, "torch": torch.__version__, "python": platform.python_version()}


def read_checkpoint(path: Any, store: Store | None = None) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Read and verify one checkpoint; return its manifest and tensors (CPU).

    ``path`` is a local checkpoint directory or, with ``store``, a location that ``store`` listed.
    Every file's checksum is verified before this returns. Tensors of a local checkpoint are
    views of a private, copy-on-write mapping of its files: nothing is copied until they are
    used, and writing to them never changes the checkpoint.
    """
    if store is None:
        path = Path(path)
        store = LocalStore(path.parent, create=False)
    manifest = store.read_manifest(path)
    sections = {}
    for name, entry in manifest.files.items():
        sections[name], _ = store.read_data(path, name, entry["size"], entry["xxh3_64"])
    try:
        tensors = {name: entry_view(sections[e["file"]], e) for name, e in manifest.tensors.items()}
    except RuntimeError as e:
        raise CorruptCheckpointError(f"manifest tensor index is inconsistent: {e}") from None
    return manifest, tensors


CHECKPOINTER_OPTIONS = tuple(
    name for name, p in inspect.signature(Checkpointer.__init__).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
)
"""The option keywords of :class:`Checkpointer` (every other keyword registers an object)."""


__all__ = ["Checkpointer", "CheckfreqError", "read_checkpoint"]
