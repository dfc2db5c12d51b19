"""The Checkpointer's memory tier: where each snapshot lands, its commit, restore and clean-up.

Every snapshot (a memory-only one, or the one a persist writes to disk from) is copied into a
slot of this rank's shared-memory region (:mod:`checkfreq.storage.shm`) instead of a private
buffer, so a restarted process finds the newest state in memory. Memory-only snapshots are
committed by a thread of their own, so they never queue behind a persist; a persist commits
its slot before writing it to disk and keeps it from being overwritten until the write is done.

If /dev/shm has no room, the tier turns itself off with one warning and checkpoints go to disk
as without it.

Under torch.distributed the ranks of one machine (those whose regions share its shared memory,
learned at start: :func:`checkfreq.ranks.sharing.memory_group`) keep one copy of the replicated
state between them: each rank's slot holds its share of it and its own private state
(:mod:`checkfreq.ranks.group_share`), so a machine of L ranks holds the replicated state once, not
L times, and each rank copies 1/L of it. A restore reads the group's other shares straight from
their regions on the same machine (:meth:`MemoryTier.complete`). Sharded state is each rank's own
(its shards). With ``replicas=k`` each snapshot is also copied to a rank of k other machines
(:mod:`checkfreq.pipeline.tiers.memory.replicas`), and a share this machine lacks is read from the copy kept here.
Then the region has three slots, not two, and a snapshot is begun only once the previous one's copies
are kept (:meth:`MemoryTier.target`): the step every rank can restore from stays in memory, however far
the copies lag (docs/storage.md, "Copies that lag").

A slot that CUDA tensors are copied into, or restored from, is registered with the CUDA runtime
the first time (:class:`~checkfreq.storage.host_pinning.HostRegistry`), so the copy runs on the
snapshot's side stream at the pinned bandwidth and only the fence waits for it; registering is a
one-time cost, counted with the region's creation, not the cadence's.

A snapshot copied from a GPU, of :data:`SEAL_AFTER_BYTES` or more, is committed as soon as its
copy is complete (the slot header is the commit marker) and its checksum is computed afterwards
by a thread of its own (:meth:`~checkfreq.storage.shm.MemoryRegion.seal`, 64 MiB chunks hashed in
parallel): a CPU pass over a 12.5 GB state takes longer than a training step, and the next
snapshot must wait for the previous commit, so the pass must not be part of it. Other snapshots
are checksummed in the commit: on a CPU host the copy itself runs on the cores training uses, and
the memory cadence counts the commit's copy and checksum as the snapshot's cost.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from checkfreq.errors import CheckfreqError
from checkfreq.pipeline.capture.snapshot import PendingSnapshot
from checkfreq.pipeline.capture.writer import Writer
from checkfreq.pipeline.tiers.memory.neighbours import kept_copy, share_on_machine
from checkfreq.pipeline.tiers.memory.replica_parts import usable_steps
from checkfreq.pipeline.tiers.memory.replicas import ReplicaLink
from checkfreq.pipeline.tiers.memory.slot_pinning import SlotPinning
from checkfreq.pipeline.tiers.memory.target import MemoryTarget, SlotManifests, SlotViews, seal_later
from checkfreq.pipeline.tiers.roles import (
    HeldCopy,
    HeldSnapshot,
    HeldState,
    SnapshotKey,
    SnapshotRequest,
    SnapshotTaker,
    SnapshotTarget,
    StateKeeper,
    TierName,
)
from checkfreq.policies.memory_cadence import MemoryCadence
from checkfreq.ranks.group_share import Group, GroupSharer
from checkfreq.ranks.shares import SHARDED
from checkfreq.run.state import replicated
from checkfreq.storage.format import Manifest, entry_view
from checkfreq.storage.shm import (
    COPIED_SLOTS,
    SLOTS,
    MemoryRegion,
    ShmCapacityError,
    SlotInfo,
    layout_signature,
)
from checkfreq.storage.shm_listing import listed_regions
from checkfreq.storage.shm_paths import replica_path

log = logging.getLogger("checkfreq.memory")
T = TypeVar("T")


class MemoryTier(SnapshotTaker, StateKeeper):
    """One rank's memory tier for a Checkpointer with ``memory=``.

    Args:
        directory: the checkpoint directory (path or URL) the region is named after.
        cadence: when memory-only snapshots are taken.
        data_file: the data file name the snapshot's manifest refers to.
        group: the ranks of this machine that keep the state together (None: this rank keeps all of it).
        copied: its snapshots are copied to other machines (``replicas=``): the region has
            :data:`~checkfreq.storage.shm.COPIED_SLOTS` slots.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        cadence: MemoryCadence,
        *,
        data_file: str,
        rank: int = 0,
        group: Group | None = None,
        failure_timeout: float = 30.0,
        copied: bool = False,
    ) -> None:
        self.directory, self.rank = directory, rank
        self.failure_timeout = failure_timeout
        self.link: ReplicaLink | None = None
        """Copies of this rank's snapshots on another machine, and of others' here (``replicas=``)."""
        self.region = MemoryRegion.for_directory(directory, rank, slots=COPIED_SLOTS if copied else SLOTS)
        self.group = group
        self._sharer = None if group is None else GroupSharer(group)
        self._sealer: ThreadPoolExecutor | None = None
        self.pinning = SlotPinning()
        """Pins slots for device copies, and says once if the device does not see them pinned."""
        self.cadence = cadence
        self._data_file = data_file
        self._manifests = SlotManifests(data_file)
        self._views = SlotViews()
        self._writer = Writer()
        self._finalizer = weakref.finalize(self, self._writer.close, None)
        self._persisting: int | None = None  # the slot a persist is writing to disk
        self._persist_done = threading.Event()  # the persist holding a slot is over (its copy in, its write out)
        self._persist_done.set()
        self._persist_committed = threading.Event()  # the persist holding a slot committed it (and offered its copy)
        self._persist_committed.set()
        self.enabled = True
        """False once /dev/shm had no room, or a job of one process has sharded state: snapshots go to disk only."""
        self.newest: HeldSnapshot | None = None
        """The newest snapshot taken into memory alone (none since a persist)."""
        self._unverified: dict[str, SlotInfo] = {}
        """The states :meth:`snapshots` gave whose data :meth:`complete` has not verified yet, by name."""

    name = TierName.MEMORY

    @property
    def busy(self) -> bool:
        """The previous memory snapshot is still being copied or committed."""
        return self._writer.busy

    def newest_step(self) -> int | None:
        """The step of the newest snapshot with a valid header (not verified), if any."""
        found = self.region.snapshots()
        return found[0].step if found else None

    # ------------------------------------------------------------------ snapshots

    def due(self, step: int, iteration_time: float) -> bool:
        """Whether a memory-only snapshot is due at ``step`` (the tier is on and its cadence says so)."""
        return self.enabled and self.cadence.due(step, iteration_time)

    def taken(self, step: int) -> None:
        """The state at ``step`` is in memory (or was restored, or counted from there)."""
        self.cadence.taken(step)

    def record_cost(self, seconds: float) -> None:
        """What a memory snapshot cost the training thread, for the cadence."""
        self.cadence.record(seconds)

    def record_device_wait(self, seconds: float) -> None:
        self.cadence.record_device_wait(seconds)

    def report_to(self, write: Callable[..., None]) -> None:
        if self.link is not None:
            self.link.report = write

    def share(
        self, tensors: dict[str, torch.Tensor], owned: set[str], objects: Mapping[str, Any], skeleton: Any
    ) -> tuple[dict[str, torch.Tensor], set[str], dict[str, Any] | None]:
        """This rank's share of the state its machine's ranks keep together (module docstring)."""
        if self._sharer is None or not self.enabled:
            return tensors, owned, None
        arrays, fenced, index = self._sharer.select(tensors, owned, replicated(tensors, objects), skeleton)
        return arrays, fenced, dict(index)

    def target(self, request: SnapshotRequest) -> MemoryTarget | None:
        """Open a slot for a snapshot of ``request.layout``; None once the tier is off (no room in
        /dev/shm, or sharded state). With ``request.device_copies`` (CUDA tensors will be copied in)
        the slot is pinned first."""
        if not self.enabled:
            return None
        if request.sharded and request.split is None:
            log.warning("memory tier off: a job of one rank with sharded (DTensor) state is not taken into memory")
            self.enabled = False
            return None
        layout = request.layout
        meta = self._manifests.meta(request)
        if self.link is not None:
            self._catch_up(self.link, request.step)
        start = time.perf_counter()
        if not self.region.fits(layout.nbytes, len(meta)):
            # the region is made again: never unregister or unmap the slot a persist still copies into
            # (the side stream) or writes to disk from (the writer), or a copy to another machine reads
            self._persist_done.wait()
            if self.link is not None and not self.link.wait_sent(self.failure_timeout):
                log.warning(
                    "memory tier: snapshot %d not taken: the region must grow, and the copy of the "
                    "previous one to ranks %s still reads it",
                    request.step,
                    self.link.sends_to,
                )
                return None
        try:
            self.region.reserve(layout.nbytes, len(meta))
        except ShmCapacityError as e:
            log.warning("memory tier off, checkpoints go to disk only: %s", e)
            self.enabled = False
            return None
        slot = self.region.begin(keep=self._held_slot())
        if request.device_copies:
            self.pinning.pin(self.region, slot.slot)
        return MemoryTarget(
            slot,
            request.step,
            layout,
            meta,
            time.perf_counter() - start,
            seal_later(request.device_copies, layout.nbytes),
            self._views.of(self.region, slot, layout),
        )

    def _catch_up(self, link: ReplicaLink, step: int) -> None:
        """Before snapshot ``step`` is begun: wait (each wait at most ``failure_timeout``) until the
        previous snapshot is offered to the keepers (its commit by a persist, its checksum) and its
        copies are kept, and until a slot other than the two newest snapshots' is free. So no rank
        overwrites the snapshot every rank can restore from while a copy lags (docs/storage.md,
        "Copies that lag"); the training thread's wait counts as the snapshot's cost."""
        self._persist_committed.wait(self.failure_timeout)
        self.wait_sealed()
        link.catch_up(step, self.failure_timeout)
        if self._persisting is not None and not self.region.spare(self._persisting):
            self._persist_done.wait(self.failure_timeout)

    def _held_slot(self) -> int | None:
        """The slot the next snapshot must not overwrite: the one a persist writes to disk, else the one
        being copied to another machine. When both are held, the copy is waited for (the busy rule),
        at most ``failure_timeout``: a copy still running then is found torn by its receiver."""
        persisting, link = self._persisting, self.link
        sending = None if link is None else link.sending
        if persisting is not None and sending is not None and sending != persisting:
            assert link is not None
            if not link.wait_sent(self.failure_timeout):
                log.warning(
                    "memory tier: the copy of a snapshot to ranks %s took over %.0f s; its slot is reused",
                    link.sends_to,
                    self.failure_timeout,
                )
            return persisting
        return persisting if persisting is not None else sending

    def commit(self, target: MemoryTarget, pending: PendingSnapshot) -> None:
        """Wait for the snapshot's deferred copies, then publish its slot."""
        pending.finish_copy()
        self.pinning.copied(target.slot.slot, pending)  # a slot not seen pinned: the copy's bandwidth, once
        info = self.region.commit(
            target.slot,
            target.step,
            target.layout.nbytes,
            target.meta,
            layout_signature(target.layout.signature),
            checksum=not target.seal_later,
            course=self.course,
        )
        if target.seal_later:  # copied once sealed: a copy is checked by its checksum
            if self._sealer is None:
                self._sealer = ThreadPoolExecutor(1, thread_name_prefix="checkfreq-seal")
            self._sealer.submit(self._seal, info)
        elif self.link is not None:
            self.link.offer(self.region, info)

    def _seal(self, info: SlotInfo) -> None:
        """Compute the checksum of a snapshot committed without it, then offer its copy."""
        sealed = self.region.seal(info)
        if sealed is not None and self.link is not None:
            self.link.offer(self.region, sealed)

    def wait_sealed(self) -> None:
        """Wait until the checksums of the committed snapshots are written (or given up: slot reused)."""
        if self._sealer is not None:
            self._sealer.submit(lambda: None).result()

    def wait(self, timeout: float) -> BaseException | None:
        """Wait for the memory snapshot being committed (and copied to another machine, with replicas);
        return its error if it failed."""
        self._writer.wait(timeout)
        if self.link is not None:
            self.link.wait_sent(min(timeout, self.failure_timeout))
        error = self._writer.take_error()
        if error is not None:
            self.newest = None  # never committed: nothing to persist from it
        return error

    def submit(self, target: SnapshotTarget, pending: PendingSnapshot, skeleton: Any, epoch: int | None) -> Writer:
        """Commit a memory-only snapshot in the background (the previous one must be committed)."""
        assert isinstance(target, MemoryTarget)  # this tier's own target
        self.newest = HeldSnapshot(pending, skeleton, target.step, epoch)

        def job() -> None:
            start = time.thread_time()  # the cores it takes: waiting for one on a loaded machine is no cost
            self.commit(target, pending)
            self.cadence.record_background(time.thread_time() - start)

        self._writer.submit(job)
        self.taken(target.step)
        return self._writer

    def unpersisted(self, durable_step: int) -> HeldSnapshot | None:
        newest = self.newest
        return newest if newest is not None and newest.step > durable_step else None

    def around_persist(
        self, target: SnapshotTarget | None, pending: PendingSnapshot, persist: Callable[[], T]
    ) -> Callable[[], T]:
        """The writer job of a persist whose snapshot landed in a slot (``target``): commit the slot,
        then write it to disk; the slot stays untouched by memory snapshots until the write is done."""
        if not isinstance(target, MemoryTarget):  # the snapshot is elsewhere: nothing to commit here
            return persist
        self._persisting = target.slot.slot
        self._persist_done.clear()
        self._persist_committed.clear()
        self.newest = None  # the persist supersedes any memory-only snapshot
        self.taken(target.step)

        def job() -> T:
            try:
                try:
                    self.commit(target, pending)
                finally:
                    self._persist_committed.set()
                return persist()
            finally:
                self._persisting = None
                self._persist_done.set()

        return job

    # ------------------------------------------------------------------ restore

    def snapshots(
        self, step: int | None = None, *, device_copies: bool = False
    ) -> tuple[list[HeldState], list[tuple[str, str]]]:
        """Every snapshot with a valid header and manifest (or those at ``step``), newest first, and the
        (slot, reason) of those skipped; with ``device_copies`` (restored onto a GPU) the newest slot is
        pinned before it is read. Its data is verified by :meth:`complete`, for the one snapshot the
        ranks choose only: one pass over the bytes restored, not one over every slot. A checksum still
        being computed is waited for: what is restored is verified."""
        self.wait_sealed()
        self._unverified = {}
        states: list[HeldState] = []
        skipped: list[tuple[str, str]] = []
        for info in self.region.snapshots():
            if step is not None and info.step != step:
                continue
            if device_copies and not states:  # the newest valid one is restored: its copies go to the device
                self.pinning.pin(self.region, info.slot)
            name = f"memory slot {info.slot}"
            try:
                data, meta = self.region.slot_bytes(info)  # views: restore copies into the live objects
                manifest = Manifest.from_json(meta, step=info.step)  # sealed: checked on its own
                tensors = {name: entry_view(data, entry) for name, entry in manifest.tensors.items()}
            except CheckfreqError as e:
                log.warning("skipping memory snapshot in slot %d: %s", info.slot, e)
                skipped.append((name, str(e)))
                continue
            self._unverified[name] = info
            states.append(HeldState(manifest, tensors, name, self, info.course))
        return states, skipped

    def complete(self, state: HeldState) -> HeldState:
        """``state`` (this rank's share) with the shares it needs of other ranks' (taken at the same
        step), each read from a region on this machine and verified (copied first: their owners
        write again once training goes on): the shares of the ranks of its machine when it was taken
        (each holds part of the replicated state) or, for sharded state restored at another world
        size, every rank's, from its own region or the replica this machine keeps of it. A
        :class:`CheckfreqError` naming the rank if one cannot be read here, or if this rank's own
        share fails its checksum (verified here, once: :meth:`snapshots`)."""
        if (info := self._unverified.pop(state.name, None)) is not None:
            self.region.read(info, private=False)
        split = state.manifest.distributed
        if split is None:
            return state
        sharded = [name for name, record in split["tensors"].items() if record["kind"] == SHARDED]
        resharded = bool(sharded) and split["world_size"] != (1 if self.group is None else self.group.world_size)
        if resharded:
            others = [rank for rank in range(split["world_size"]) if rank != self.rank]
        elif _stored_names(split) <= state.tensors.keys():
            return state  # its whole state: nothing is kept by another rank (sharded state, a machine of one)
        else:
            others = [rank for rank in split["group"] if rank != self.rank]
        step = state.manifest.step
        tensors = dict(state.tensors)
        records = {name: {**record, "parts": list(record["parts"])} for name, record in split["tensors"].items()}
        for rank in others:
            manifest, arrays = share_on_machine(self.directory, rank, step, state.course)
            tensors.update(arrays)
            try:
                for name in sharded if resharded else ():
                    records[name]["parts"] += manifest.distributed["tensors"][name]["parts"]  # type: ignore[index]
            except (KeyError, TypeError) as e:
                raise CheckfreqError(f"rank {rank}'s share of memory snapshot {step} does not record {e}") from None
        manifest = dataclasses.replace(state.manifest, distributed={**split, "tensors": records})
        return dataclasses.replace(state, manifest=manifest, tensors=tensors)

    @property
    def keeps_copies(self) -> bool:
        return self.link is not None

    def holdings(self) -> tuple[list[SnapshotKey], dict[int, list[SnapshotKey]]]:
        """This rank's snapshots and the copies its machine keeps (its first rank reports those)."""
        copies: dict[int, list[SnapshotKey]] = {}
        for rank, region in (
            listed_regions(self.directory, "replica")
            if self.group is None or self.rank == min(self.group.ranks)
            else ()
        ):
            try:  # those this machine can make whole (a copy may leave replicated pieces out)
                copies[rank] = usable_steps(self.directory, region)
            finally:
                region.release(remove=False)
        return [(info.step, info.course) for info in self.region.snapshots()], copies

    def read_copy(self, rank: int, key: SnapshotKey) -> HeldCopy:
        return kept_copy(self.directory, rank, *key)

    def adopt(self, copy: HeldCopy) -> None:
        """Commit ``copy`` into a slot of this rank's region, checked against the checksum it was kept with."""
        self.region.reserve(copy.data.numel(), len(copy.meta))
        slot = self.region.begin(keep=self._held_slot())
        slot.data[: copy.data.numel()].copy_(copy.data)
        self.region.commit(
            slot, copy.step, copy.data.numel(), copy.meta, copy.signature, expect=copy.checksum, course=copy.course
        )

    def forget_newer_than(self, step: int) -> None:
        """The run went back to ``step``: snapshots of later steps belong to an abandoned timeline, and
        so do the copies of later steps this machine keeps for other ranks (its first rank clears them,
        before any rank's next step can send a new copy: that step waits for this rank's collectives)."""
        self.wait_sealed()  # a seal in flight never writes a header back after the clear
        if (newest := self.newest_step()) is not None and newest > step:
            log.info("memory tier: dropping snapshots after step %d (restored an older step)", step)
            self.region.clear()
        if self.group is not None and self.rank != min(self.group.ranks):
            return
        for rank, region in listed_regions(self.directory, "replica"):
            try:
                if any(info.step > step for info in region.snapshots()):
                    log.info("memory tier: dropping the copies of rank %d's snapshots after step %d", rank, step)
                    region.clear()
            finally:
                region.release(remove=False)

    def close(self, *, remove: bool, timeout: float | None = None) -> None:
        """Stop the commit thread; with ``remove`` (a clean close) delete the region too."""
        self._writer.close(timeout)
        self._finalizer.detach()
        self.newest = None
        if self._sealer is not None:  # a checksum being computed reads the region: it goes first
            self._sealer.shutdown(wait=True, cancel_futures=remove)
        if self.link is not None:  # a copy being sent reads the region: it goes first
            self.link.close(self.failure_timeout if timeout is None else min(timeout, self.failure_timeout))
            if remove:  # the job is done: the copies kept for others are of no use
                for sender in self.link.receives_from:
                    replica_path(self.directory, sender).unlink(missing_ok=True)
        self._views.clear()
        self.region.release(remove=remove)

    def release(self) -> None:
        """Nothing to give back: the region is this rank's alone, removed or kept at :meth:`close`."""


def _stored_names(split: Mapping[str, Any]) -> set[str]:
    """The names of the arrays the tensors of a group's index are stored under, on any of its ranks."""
    names = set()
    for record in split["tensors"].values():
        for part in record["parts"]:
            if part is not None:
                names.add(part if isinstance(part, str) else part[0])
    return names
