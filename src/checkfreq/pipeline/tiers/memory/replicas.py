"""Copies of a rank's memory snapshots in other machines' shared memory (``replicas=``).

Each rank with keepers (:func:`checkfreq.ranks.group_share.replica_ring`: one rank on each of
``replicas`` other machines) sends every memory snapshot it commits, less what every other machine
holds too (its replicated pieces: :mod:`checkfreq.pipeline.tiers.memory.replica_parts`), to each keeper in turn,
over a gloo group of its own, on a thread of its own. Training waits for it only at the next snapshot,
and only if the copy is still in flight then (:meth:`ReplicaLink.catch_up`, bounded by
``failure_timeout``): a copy never falls more than one snapshot behind, which keeps the step every
rank can restore from in memory (docs/storage.md, "Copies that lag"). A rank keeps the snapshots it
receives in a region of its machine's shared memory named after the sender
(:func:`checkfreq.storage.shm_paths.replica_path`, :data:`~checkfreq.storage.shm.COPIED_SLOTS` slots:
the two newest copies and the one arriving), each slot committed only once its bytes match the
sender's checksum: a copy cut short (the sender died) or damaged on the way is never used, and never
takes the place of the two newest whole ones.

On the wire, each snapshot is a :class:`CopyHeader` (:attr:`CopyHeader.WIDTH` int64 values: kind, step,
the copy's data and manifest bytes and checksum, layout signature), its data (in pieces of at most
64 MiB) and its manifest (the slot's, or an envelope around it saying what was left out), and the
keeper answers with a :class:`CopyAnswer` (the step it kept, or none); once every keeper answered,
the sender's slot is free again and :meth:`ReplicaLink.wait_sent` returns. A keeper that fails is
sent no more copies; the others still are. A header of kind :data:`STOP` ends the copies at a clean
close. Both messages are typed values with one encoder and one decoder (``to_tensor``/``from_tensor``).

A rank that dies closes its connections, which ends the copy threads' waits on it at once; a rank
that freezes (its machine stalled, its connections open) does not. So, given the job's
:class:`~checkfreq.ranks.liveness.Liveness`, a watch thread looks at the heartbeats of every rank a
copy thread waits on while the link is open: the senders whose copies this rank keeps (between
copies too) and the keeper a copy is being sent to. One silent for the failure timeout is lost: the
liveness publishes the job's failure and ends this process (and every rank that reads it) so that
torchrun restarts the job, whatever the copy threads and the training thread are blocked in.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from checkfreq.errors import CheckfreqError, PeerLostError
from checkfreq.pipeline.tiers.memory.replica_parts import Outgoing, outgoing, pieces_of
from checkfreq.ranks.liveness import Liveness
from checkfreq.storage.shm import COPIED_SLOTS, MemoryRegion, ShmCapacityError, SlotInfo
from checkfreq.storage.shm_paths import device_and_inode, replica_path

log = logging.getLogger("checkfreq.memory")

SNAPSHOT, STOP = 1, 0
"""A :class:`CopyHeader`'s kinds: a snapshot's copy follows; the copies end (a clean close)."""
COPY_TAG, ACK_TAG = 1, 2
"""gloo tags: a sender's copies, and the keeper's answer (the step kept, or -1), which may travel
between the same two ranks at once the other way."""
WATCH_S = 0.1
"""How often the watch thread looks at the awaited ranks' liveness (it reads each heartbeat less often)."""
WATCHED = "the copies of memory snapshots between machines (replicas=)"
"""What the ranks are doing, as a lost rank's error names it."""
_SIGNED = struct.Struct("<q")
_UNSIGNED = struct.Struct("<Q")


@dataclass(frozen=True)
class Sent:
    """One snapshot copied to a keeper: for the events and the docs' figures."""

    step: int
    nbytes: int
    seconds: float
    to: int = -1
    """The keeper."""


def _signed(value: int) -> int:
    return _SIGNED.unpack(_UNSIGNED.pack(value))[0]


def _unsigned(value: int) -> int:
    return _UNSIGNED.unpack(_SIGNED.pack(value))[0]


@dataclass(frozen=True)
class CopyHeader:
    """Sender → keeper, before a copy's data and manifest: what follows (on the wire: :attr:`WIDTH`
    int64 values, the checksum's 64 bits as a signed value, the signature as two, and the course)."""

    WIDTH: ClassVar[int] = 8
    """int64 values on the wire."""

    kind: int
    """:data:`SNAPSHOT`: a copy follows; :data:`STOP`: the copies end, nothing follows."""
    step: int
    data_bytes: int
    """The copy's data bytes (what it carries of the slot's data)."""
    meta_bytes: int
    """Its manifest's bytes (the slot's, or an envelope)."""
    checksum: int
    """The copy's xxh3-64 checksum (unsigned)."""
    signature: bytes
    """The slot's 16-byte layout signature."""
    course: int = 0
    """The slot's course (:attr:`~checkfreq.storage.shm.SlotInfo.course`): the copy is kept with it."""

    @classmethod
    def announcing(cls, info: SlotInfo) -> CopyHeader:
        """The header announcing the copy of ``info`` (an
        :class:`~checkfreq.pipeline.tiers.memory.replica_parts.Outgoing`'s)."""
        return cls(SNAPSHOT, info.step, info.data_bytes, info.meta_bytes, info.checksum, info.signature, info.course)

    @classmethod
    def stop(cls) -> CopyHeader:
        """The header that ends the copies (all zeros on the wire)."""
        return cls(STOP, 0, 0, 0, 0, bytes(16))

    @property
    def info(self) -> SlotInfo:
        """The announced copy's step, sizes, checksum, signature and course (slot and sequence 0)."""
        return SlotInfo(0, 0, self.step, self.data_bytes, self.meta_bytes, self.signature, self.checksum, self.course)

    def to_tensor(self) -> torch.Tensor:
        low, high = struct.unpack("<qq", self.signature)
        values = [
            self.kind,
            self.step,
            self.data_bytes,
            self.meta_bytes,
            _signed(self.checksum),
            low,
            high,
            self.course,
        ]
        return torch.tensor(values, dtype=torch.int64)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> CopyHeader:
        kind, step, data_bytes, meta_bytes, checksum, low, high, course = (int(v) for v in tensor.tolist())
        return cls(kind, step, data_bytes, meta_bytes, _unsigned(checksum), struct.pack("<qq", low, high), course)

    @classmethod
    def empty(cls) -> torch.Tensor:
        """A tensor to receive one header into."""
        return torch.empty(cls.WIDTH, dtype=torch.int64)


@dataclass(frozen=True)
class CopyAnswer:
    """Keeper → sender, once a copy arrived: the step it kept (None: it did not keep the copy). On the
    wire: one int64, -1 for None."""

    WIDTH: ClassVar[int] = 1
    """int64 values on the wire."""

    kept: int | None

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([-1 if self.kept is None else self.kept], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> CopyAnswer:
        (kept,) = (int(v) for v in tensor.tolist())
        return cls(None if kept == -1 else kept)

    @classmethod
    def empty(cls) -> torch.Tensor:
        """A tensor to receive one answer into."""
        return torch.empty(cls.WIDTH, dtype=torch.int64)


_IN_FLIGHT_ADVICE = (
    "a copy took longer than the failure timeout: a lost node resumes from the newest copy its keeper "
    "holds; look for a stalled link or keeper"
)
_WAIT_ADVICE = (
    "copying takes longer than snapshotting here, and a snapshot waits until the copies of the one before are "
    "kept, so that a lost node's state stays in memory; snapshot less often (memory=N steps) for the copies to "
    "keep up"
)


class ReplicaLink:
    """This rank's copies to its keepers and its keeping of the copies other ranks send it.

    Args:
        group: the gloo group of the copies (every rank's, created collectively).
        directory: the checkpoint directory the replica regions are named after.
        sends_to: the ranks this one copies its snapshots to, in turn (one rank, or None: none).
        receives_from: the ranks whose snapshots this one keeps.
        liveness: the job's heartbeats, watched for every rank a copy thread waits on (None: no
            watch; a frozen peer is then found only by the group's gloo timeout).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        directory: str | os.PathLike[str],
        *,
        sends_to: int | Sequence[int] | None,
        receives_from: list[int],
        liveness: Liveness | None = None,
    ) -> None:
        self.group, self.directory = group, directory
        self.sends_to = [] if sends_to is None else [sends_to] if isinstance(sends_to, int) else list(sends_to)
        self.receives_from = list(receives_from)
        self.sent: list[Sent] = []
        """Every snapshot copied so far (this session)."""
        self.report: Callable[..., None] = lambda event, **fields: None
        """Where the copies are recorded (the run's event log: :meth:`EventLog.write`)."""
        self.kept: dict[int, int] = {}
        """Sender → step of the newest copy kept for it."""
        self._offers: queue.SimpleQueue[tuple[MemoryRegion, SlotInfo] | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self.sending: int | None = None
        """The slot being copied (it must not be overwritten until the copy is done)."""
        self._warned: set[str] = set()
        """The reasons a copy was skipped for that were logged (each once)."""
        self._broken: dict[int, BaseException] = {}
        """Keeper → why copying to it failed (it is sent no more copies this session)."""
        self._sending_to: int | None = None
        """The keeper a copy is being sent to (the send thread waits on it)."""
        self._closing = threading.Event()
        self._threads = []
        if self.sends_to:
            self._threads.append(threading.Thread(target=self._send_loop, name="checkfreq-replica-send", daemon=True))
        self._keepers = {
            sender: threading.Thread(
                target=self._keep_loop, args=(sender,), name=f"checkfreq-replica-keep-{sender}", daemon=True
            )
            for sender in self.receives_from
        }
        self._threads += self._keepers.values()
        if liveness is not None and self._threads:
            self._threads.append(
                threading.Thread(target=self._watch, args=(liveness,), name="checkfreq-replica-watch", daemon=True)
            )
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ sending

    def offer(self, region: MemoryRegion, info: SlotInfo) -> bool:
        """Copy the snapshot of ``info`` (committed in ``region``, its checksum computed) to the keepers
        in the background, one after the other, unless the previous copy is still in flight (it
        outlasted :meth:`catch_up`'s wait) or no keeper can take it; whether it goes."""
        if not self._live():
            return False
        if not self._idle.is_set():  # the previous copy outlasted the wait for it
            return self._skip(info.step, "the previous copy is in flight", _IN_FLIGHT_ADVICE)
        self._idle.clear()
        self.sending = info.slot
        self._offers.put((region, info))
        return True

    def _skip(self, step: int, reason: str, advice: str) -> bool:
        """A snapshot not copied: an event each time, a warning the first time for each reason."""
        self.report("replica skipped", step=step, to=self.sends_to, reason=reason)
        if reason not in self._warned:
            self._warned.add(reason)
            log.warning(
                "memory tier: snapshot %d is not copied to rank %s (%s): %s. Said once; each snapshot not "
                "copied is a 'replica skipped' event of the run's log",
                step,
                ", ".join(map(str, self.sends_to)),
                reason,
                advice,
            )
        return False

    def catch_up(self, step: int, timeout: float) -> float:
        """Before snapshot ``step``: wait until the previous snapshot's copies are done, at most
        ``timeout`` seconds; the seconds waited. A wait is a ``replica wait`` event, and said once."""
        if self._idle.is_set():
            return 0.0
        start = time.perf_counter()
        done = self._idle.wait(timeout)
        seconds = time.perf_counter() - start
        self.report("replica wait", step=step, seconds=seconds, to=self.sends_to, done=done)
        if "wait" not in self._warned:
            self._warned.add("wait")
            log.warning(
                "memory tier: snapshot %d waited %.2f s for the copy of the previous one to rank %s: %s. "
                "Said once; each wait is a 'replica wait' event of the run's log",
                step,
                seconds,
                ", ".join(map(str, self.sends_to)),
                _WAIT_ADVICE,
            )
        return seconds

    def wait_sent(self, timeout: float) -> bool:
        """Wait until no copy is in flight, at most ``timeout`` seconds; whether none is."""
        return self._idle.wait(timeout)

    def _live(self) -> list[int]:
        """The keepers copies still go to."""
        return [to for to in self.sends_to if to not in self._broken]

    def _send_loop(self) -> None:
        while (offer := self._offers.get()) is not None:
            region, info = offer
            try:
                copy = outgoing(*region.slot_bytes(info), info)
                for to in self._live():
                    self._send(copy, info, to)
            except CheckfreqError as e:  # its manifest cannot be read: nothing to tell a copy by
                log.warning("memory tier: snapshot %d is not copied to another machine: %s", info.step, e)
            finally:
                self.sending = None
                self._idle.set()
        for to in self._live():
            try:
                dist.send(CopyHeader.stop().to_tensor(), group=self.group, group_dst=to, tag=COPY_TAG)
            except RuntimeError as e:
                log.debug("memory tier: rank %d did not take the end of the replicas: %s", to, e)

    def _send(self, copy: Outgoing, info: SlotInfo, to: int) -> None:
        """Send ``copy`` (of the slot ``info``) to keeper ``to`` and wait for its answer; a keeper that
        fails (it died, or left) is sent no more copies."""
        start = time.perf_counter()
        self._sending_to = to
        try:
            dist.send(CopyHeader.announcing(copy.info).to_tensor(), group=self.group, group_dst=to, tag=COPY_TAG)
            for piece in copy.pieces():
                dist.send(piece, group=self.group, group_dst=to, tag=COPY_TAG)
            dist.send(
                torch.frombuffer(bytearray(copy.meta), dtype=torch.uint8), group=self.group, group_dst=to, tag=COPY_TAG
            )
            received = CopyAnswer.empty()
            dist.recv(received, group=self.group, group_src=to, tag=ACK_TAG)
            answer = CopyAnswer.from_tensor(received)
        except RuntimeError as e:
            self._broken[to] = e
            log.warning(
                "memory tier: copying snapshot %d to rank %d failed (%s); no more replicas are sent to it",
                info.step,
                to,
                e,
            )
            return
        finally:
            self._sending_to = None
        seconds, nbytes = time.perf_counter() - start, copy.info.data_bytes + copy.info.meta_bytes
        if answer.kept == info.step:
            self.sent.append(Sent(info.step, nbytes, seconds, to))
        self.report(
            "replica",
            step=info.step,
            to=to,
            bytes=nbytes,
            data_bytes=copy.info.data_bytes,
            slot_bytes=info.data_bytes + info.meta_bytes,
            seconds=seconds,
            kept=answer.kept == info.step,
        )

    # ------------------------------------------------------------------ keeping

    def _keep_loop(self, sender: int) -> None:
        region = MemoryRegion(
            replica_path(self.directory, sender), device_and_inode(self.directory), slots=COPIED_SLOTS
        )
        received = CopyHeader.empty()
        try:
            while True:
                dist.recv(received, group=self.group, group_src=sender, tag=COPY_TAG)
                header = CopyHeader.from_tensor(received)
                if header.kind == STOP:
                    return
                kept = self._keep(region, sender, header.info)
                answer = CopyAnswer(header.step if kept else None)
                dist.send(answer.to_tensor(), group=self.group, group_dst=sender, tag=ACK_TAG)
        except RuntimeError as e:  # the sender died or left: its copy in flight, if any, is never committed
            log.info("memory tier: no more replicas from rank %d (%s)", sender, str(e).strip().splitlines()[0])
        finally:
            region.release(remove=False)

    def _keep(self, region: MemoryRegion, sender: int, info: SlotInfo) -> bool:
        """Receive the snapshot ``info`` announces into a slot; commit it if its bytes match (if no slot
        can hold it, the bytes are received and dropped: the sender is told it was not kept)."""
        try:
            region.reserve(info.data_bytes, info.meta_bytes)
        except ShmCapacityError as e:
            for piece in pieces_of(torch.empty(info.data_bytes, dtype=torch.uint8), info.data_bytes):
                dist.recv(piece, group=self.group, group_src=sender, tag=COPY_TAG)
            dist.recv(torch.empty(info.meta_bytes, dtype=torch.uint8), group=self.group, group_src=sender, tag=COPY_TAG)
            log.warning("memory tier: no room for the replica of rank %d's snapshot %d: %s", sender, info.step, e)
            self.report("replica refused", step=info.step, sender=sender, reason=str(e))
            return False
        slot = region.begin()
        for piece in pieces_of(slot.data, info.data_bytes):
            dist.recv(piece, group=self.group, group_src=sender, tag=COPY_TAG)
        meta = torch.empty(info.meta_bytes, dtype=torch.uint8)
        dist.recv(meta, group=self.group, group_src=sender, tag=COPY_TAG)
        try:
            region.commit(
                slot,
                info.step,
                info.data_bytes,
                meta.numpy().tobytes(),
                info.signature,
                expect=info.checksum,
                course=info.course,
            )
        except CheckfreqError as e:
            log.warning("memory tier: the replica of rank %d's snapshot %d is not kept: %s", sender, info.step, e)
            self.report("replica refused", step=info.step, sender=sender, reason=str(e))
            return False
        self.kept[sender] = info.step
        return True

    # ------------------------------------------------------------------ watching

    def _watch(self, liveness: Liveness) -> None:
        """Until the link closes: the liveness of the senders whose keeper threads still wait for
        their copies, and of the keeper a copy is being sent to. A rank found lost ends the watch (the
        liveness has published the job's failure and will end this process)."""
        while not self._closing.wait(WATCH_S):
            awaited = {sender for sender, thread in self._keepers.items() if thread.is_alive()}
            if (to := self._sending_to) is not None:
                awaited.add(to)
            try:
                liveness.check(sorted(awaited), WATCHED)
            except PeerLostError:  # logged by the liveness, which ends this process
                return

    # ------------------------------------------------------------------ end

    def close(self, timeout: float) -> None:
        """End the copies: the sender finishes the one in flight and tells its keepers; the keepers
        end at their senders' word (each waited for at most ``timeout`` seconds); the watch ends at once
        (the job's heartbeats stop after the close)."""
        self._closing.set()
        self._offers.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        left = [t.name for t in self._threads if t.is_alive()]
        if left:
            log.warning("memory tier: %s still running after %.0f s at close", ", ".join(left), timeout)
