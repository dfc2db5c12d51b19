"""The copies of memory snapshots on other machines (``replicas=``) at N ranks, as
``benchmarks/protocol_sim.py`` runs and counts them.

* **Each snapshot**: a rank's copy goes to each of its ``replicas`` keepers in turn, point to point, by
  :class:`checkfreq.pipeline.tiers.memory.replicas.ReplicaLink` (header, data, envelope; the keeper's answer).
  :func:`copy_counts` runs real links (their own threads, real shared-memory regions, the
  keeper's checksum check) over :class:`Wire`, an in-memory stand-in for the two calls of
  ``torch.distributed`` the link makes (``send`` and ``recv``), which counts each rank's messages
  and bytes. The stand-in has nothing else: a collective or a store operation would fail the run.
  Each rank's slot is as the memory tier builds it (:func:`slot`: its share of its machine's copy
  of the replicated state, cut by ``ranks.group_share.GroupSharer``, its private tensors and
  ``own_bytes`` of state of its own, and the manifest beside them); what the link sends of it is
  what ``pipeline.tiers.memory.replica_parts.outgoing`` makes of it (:func:`sent`: the slot less its runs of
  replicated pieces, which every other machine holds, and an envelope around the manifest).
  :func:`per_snapshot` takes who copies to whom at N from ``ranks.group_share.replica_ring`` (the
  function the start-up runs) and gives every rank the counts of the copies it sends and keeps,
  as measured on the copies of the first and the last machine (:func:`copy_counts`; another rank's
  differ from the last machine's rank of its local index by the digits of its rank numbers in
  the manifest).
* **At restore** (the fetch round, ``pipeline.restore.copies.fetch_copies``): :class:`KeptCopies`
  is a tier that holds what :class:`Loss` says each rank holds after one machine is lost with its
  memory and disk (every other rank: its own last two snapshots and the copies of its ring senders');
  protocol_sim runs the real fetch round with it on every rank's thread.
  :func:`plan_seconds` times rank 0's ``pipeline.restore.plan.fetch_plan`` over the same reports.
"""

from __future__ import annotations

import contextlib
import os
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.scale_costs import PRIVATE_TENSORS, replicated_state, skeleton
from checkfreq.errors import CheckfreqError
from checkfreq.pipeline.restore.messages import MemoryReport
from checkfreq.pipeline.restore.plan import fetch_plan
from checkfreq.pipeline.tiers.memory import replicas
from checkfreq.pipeline.tiers.memory.replica_parts import outgoing
from checkfreq.pipeline.tiers.memory.replicas import ReplicaLink
from checkfreq.pipeline.tiers.roles import HeldCopy, SnapshotKey, StateKeeper
from checkfreq.ranks.group_share import Group, GroupSharer, groups_of, replica_ring
from checkfreq.storage.format import Manifest, data_file_name, plan_layout, tensor_entries
from checkfreq.storage.shm import MemoryRegion, SlotInfo, layout_signature
from checkfreq.storage.shm_paths import SHM_DIR_ENV, device_and_inode

RANKS_PER_MACHINE = 8
"""Ranks to a machine (each with its shared memory)."""
REPLICAS = 1
"""The copies of each snapshot, on as many other machines (``replicas=``)."""
STRIDE = 1
"""``replica_stride=1``: machine ``i`` copies to machines ``i + 1``, ``i + 2``, ... (``replicas`` of them)."""
STEPS = (90, 100)
"""The memory snapshots every rank holds (two slots), and the copies it keeps of its sender's."""
COURSE = 1
"""The course every snapshot and copy is of (one run, no restore since)."""
DISK_STEP = 50
"""The newest step on disk, which the survivors list."""
OWN_BYTES = 1 << 20
"""State of a rank's own in each snapshot (FSDP2's shards, say), beside its share of the replicated state."""
TIMEOUT_S = 120.0


def machines(world: int, per_machine: int) -> list[str]:
    """Each rank's machine key, ``per_machine`` ranks to a machine in rank order."""
    return [f"machine {rank // per_machine}" for rank in range(world)]


def ring(
    world: int, per_machine: int, replicas: int = REPLICAS, stride: int = STRIDE
) -> list[tuple[list[int], list[int]]]:
    """Each rank's (keepers, senders), as the start-up computes them."""
    return replica_ring(groups_of(machines(world, per_machine)), replicas, stride)


# ---------------------------------------------------------------------------------- one snapshot


def slot(world: int, rank: int, per_machine: int, layers: int, own_bytes: int = OWN_BYTES) -> tuple[int, bytes]:
    """(data bytes, manifest) of rank ``rank``'s memory snapshot in a job of ``world`` ranks: a DDP job of
    ``layers`` linear layers and AdamW (``benchmarks/scale_costs.py``), its machine keeping one copy
    of the replicated state, plus ``own_bytes`` of the rank's own state."""
    tensors = replicated_state(layers)
    own: dict[str, torch.Tensor] = {
        name: torch.zeros(shape, dtype=dtype) for name, (dtype, shape) in PRIVATE_TENSORS.items()
    }
    own["own"] = torch.zeros(own_bytes, dtype=torch.uint8)
    first = rank - rank % per_machine
    group = Group(tuple(range(first, min(first + per_machine, world))), rank, world)
    arrays, _, index = GroupSharer(group).select({**tensors, **own}, set(), set(tensors), skeleton(tensors))
    layout = plan_layout({name: (array.dtype, tuple(array.shape)) for name, array in arrays.items()})
    name = data_file_name(rank)
    manifest = Manifest(
        step=STEPS[-1],
        epoch=0,
        world_size=world,
        files={name: {"size": layout.nbytes, "xxh3_64": ""}},
        tensors=tensor_entries(layout, name),
        state=index["ranks"][0],
        versions={"checkfreq": "sim"},
        created=0.0,
        distributed=dict(index),
    )
    return layout.nbytes, manifest.to_json()


def sent(world: int, rank: int, per_machine: int, layers: int, own_bytes: int = OWN_BYTES) -> tuple[int, int]:
    """(data bytes, manifest bytes) of the copy of rank ``rank``'s :func:`slot` that goes to each keeper,
    as ``pipeline.tiers.memory.replica_parts.outgoing`` makes it: the slot's data less its runs of replicated pieces,
    and the envelope (what was left out, around the slot's manifest)."""
    data_bytes, meta = slot(world, rank, per_machine, layers, own_bytes)
    info = SlotInfo(0, 0, STEPS[-1], data_bytes, len(meta), layout_signature("sim"), 1)
    copy = outgoing(torch.zeros(data_bytes, dtype=torch.uint8), meta, info)
    return copy.info.data_bytes, copy.info.meta_bytes


@dataclass
class LinkCounts:
    """What one rank sent and received over the copies' group."""

    messages_out: int = 0
    messages_in: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    peers: set[int] = field(default_factory=set)

    def add(self, other: LinkCounts) -> None:
        self.messages_out += other.messages_out
        self.messages_in += other.messages_in
        self.bytes_out += other.bytes_out
        self.bytes_in += other.bytes_in
        self.peers |= other.peers


@dataclass(frozen=True)
class WireGroup:
    """The group a simulated rank passes to ``torch.distributed``: who is calling."""

    wire: Wire
    rank: int


class Wire:
    """``torch.distributed``'s ``send`` and ``recv`` between simulated ranks, in memory, matched by
    (sender, receiver, tag) as gloo matches them; each call counted, in the :class:`LinkCounts` of the
    calling rank, for the copy it belongs to: ``counts[(sender, keeper, rank)]`` (a copy's messages
    go on ``COPY_TAG``, its keeper's answer on ``ACK_TAG``)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int, int, int], LinkCounts] = {}
        self._lock = threading.Lock()
        self._channels: dict[tuple[int, int, int], queue.SimpleQueue[bytes]] = {}

    def _channel(self, sender: int, receiver: int, tag: int) -> queue.SimpleQueue[bytes]:
        with self._lock:
            return self._channels.setdefault((sender, receiver, tag), queue.SimpleQueue())

    def _counts(self, rank: int, copy: tuple[int, int]) -> LinkCounts:
        with self._lock:
            return self.counts.setdefault((*copy, rank), LinkCounts())

    def send(self, tensor: torch.Tensor, *, group: WireGroup, group_dst: int, tag: int = 0) -> None:
        payload = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        copy = (group.rank, group_dst) if tag == replicas.COPY_TAG else (group_dst, group.rank)
        counts = self._counts(group.rank, copy)
        with self._lock:
            counts.messages_out += 1
            counts.bytes_out += len(payload)
            counts.peers.add(group_dst)
        self._channel(group.rank, group_dst, tag).put(payload)

    def recv(self, tensor: torch.Tensor, *, group: WireGroup, group_src: int, tag: int = 0) -> None:
        try:
            payload = self._channel(group_src, group.rank, tag).get(timeout=TIMEOUT_S)
        except queue.Empty:
            raise RuntimeError(f"rank {group.rank} waited {TIMEOUT_S:.0f} s for rank {group_src}") from None
        target = tensor.view(torch.uint8).reshape(-1)
        if len(payload) != target.numel():
            raise RuntimeError(
                f"rank {group.rank} expected {target.numel()} bytes from rank {group_src}, got {len(payload)}"
            )
        target.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        copy = (group_src, group.rank) if tag == replicas.COPY_TAG else (group.rank, group_src)
        counts = self._counts(group.rank, copy)
        with self._lock:
            counts.messages_in += 1
            counts.bytes_in += len(payload)
            counts.peers.add(group_src)


@contextlib.contextmanager
def _on_wire(wire: Wire, shm: Path) -> Iterator[None]:
    """The links' ``torch.distributed`` is ``wire`` (nothing but ``send`` and ``recv``), and their
    shared memory is ``shm``."""
    before, shm_before = replicas.dist, os.environ.get(SHM_DIR_ENV)
    replicas.dist = wire  # type: ignore[assignment]
    os.environ[SHM_DIR_ENV] = str(shm)
    try:
        yield
    finally:
        replicas.dist = before
        if shm_before is None:
            os.environ.pop(SHM_DIR_ENV, None)
        else:
            os.environ[SHM_DIR_ENV] = shm_before


@dataclass
class Copied:
    """One snapshot copied by every rank of ``senders``: each rank's counts for each copy, as
    :attr:`Wire.counts` has them."""

    counts: dict[tuple[int, int, int], LinkCounts]
    kept: dict[tuple[int, int], int]
    """(sender, keeper) → the step that keeper kept of that sender's copy."""


def copy_counts(
    world: int,
    senders: Sequence[int],
    *,
    per_machine: int,
    layers: int,
    own_bytes: int = OWN_BYTES,
    directory: str | None = None,
    replicas: int = REPLICAS,
) -> Copied:
    """Each rank of ``senders`` copies one snapshot to its keepers by the ring at ``world`` ranks (``replicas``
    of them, in turn), through real :class:`ReplicaLink` links (the keepers' too) over a :class:`Wire`;
    every rank's counts of that one snapshot (the copies' end, a header sent at close, is not counted)."""
    partners = ring(world, per_machine, replicas)
    wire = Wire()
    with tempfile.TemporaryDirectory(prefix="checkfreq-replica-sim-", dir=directory) as tmp, _on_wire(wire, Path(tmp)):
        ckpt = Path(tmp) / "ckpt"
        ckpt.mkdir()
        keepers: dict[int, list[int]] = {}
        for sender in senders:
            assert partners[sender][0], f"rank {sender} has no keeper at {world} ranks"
            for to in partners[sender][0]:
                keepers.setdefault(to, []).append(sender)
        keeping = [
            ReplicaLink(WireGroup(wire, rank), ckpt, sends_to=None, receives_from=from_)  # type: ignore[arg-type]
            for rank, from_ in keepers.items()
        ]
        sending: list[ReplicaLink] = []
        regions = []
        try:
            for sender in senders:
                data_bytes, meta = slot(world, sender, per_machine, layers, own_bytes)
                region = MemoryRegion(Path(tmp) / f"own{sender:05d}", device_and_inode(ckpt))
                regions.append(region)
                region.reserve(data_bytes, len(meta))
                info = region.commit(region.begin(), STEPS[-1], data_bytes, meta, layout_signature("sim"))
                link = ReplicaLink(
                    WireGroup(wire, sender),
                    ckpt,
                    sends_to=partners[sender][0],  # type: ignore[arg-type]
                    receives_from=[],
                )
                if not (link.offer(region, info) and link.wait_sent(TIMEOUT_S)):
                    raise RuntimeError(f"rank {sender}'s copies did not go within {TIMEOUT_S:.0f} s")
                sending.append(link)
            counts = {
                key: LinkCounts(c.messages_out, c.messages_in, c.bytes_out, c.bytes_in, set(c.peers))
                for key, c in wire.counts.items()
            }  # before the ends of the copies
            kept = {
                (sender, link.group.rank): step
                for link in keeping  # type: ignore[attr-defined]
                for sender, step in link.kept.items()
            }
        finally:
            for link in sending + keeping:  # the senders end their keepers' loops
                link.close(TIMEOUT_S)
            for region in regions:
                region.release(remove=True)
    return Copied(counts, kept)


def measured_senders(world: int, per_machine: int) -> list[int]:
    """The ranks whose copies :func:`per_snapshot` reads: those of the first and the last machine."""
    return sorted(set(range(min(per_machine, world))) | set(range(world - per_machine, world)))


def per_snapshot(world: int, per_machine: int, copied: Copied, replicas: int = REPLICAS) -> list[LinkCounts]:
    """Every rank's counts for one snapshot at ``world`` ranks (each rank copies to its ``replicas``
    keepers, and keeps its senders' copies), from ``copied``: the copies of the first and the last
    machine (:func:`measured_senders`), in machines of ``per_machine`` ranks each. A rank's copy to
    its ``j``-th keeper counts as the measured rank's copy to its own ``j``-th."""
    if world % per_machine:
        raise ValueError(f"{world} ranks do not make machines of {per_machine}")
    partners = ring(world, per_machine, replicas)
    last = world - per_machine
    senders = {rank: rank if rank < per_machine else last + rank % per_machine for rank in range(world)}
    out = [LinkCounts() for _ in range(world)]
    for rank, (to, from_) in enumerate(partners):
        measured = senders[rank]
        for j, keeper in enumerate(to):
            side = copied.counts[(measured, partners[measured][0][j], measured)]
            out[rank].add(LinkCounts(side.messages_out, side.messages_in, side.bytes_out, side.bytes_in, {keeper}))
        for sender in from_:
            measured = senders[sender]
            theirs = partners[measured][0][partners[sender][0].index(rank)]
            side = copied.counts[(measured, theirs, theirs)]
            out[rank].add(LinkCounts(side.messages_out, side.messages_in, side.bytes_out, side.bytes_in, {sender}))
    return out


# -------------------------------------------------------------------------------------- the restore


@dataclass(frozen=True)
class Loss:
    """Machine ``lost`` gone with its memory and its disk (a replacement's ranks hold nothing);
    every other rank holds its own :data:`STEPS`, lists :data:`DISK_STEP` on disk, and keeps
    the copies of its ring senders' :data:`STEPS` (those of the lost machine's ranks too)."""

    world: int
    per_machine: int
    lost: int = 1
    copy_bytes: int = 4096
    """The bytes of each copy sent at restore (a stand-in for the slot)."""
    replicas: int = REPLICAS

    def is_lost(self, rank: int) -> bool:
        return rank // self.per_machine == self.lost

    def reports(self) -> list[MemoryReport]:
        """Every rank's report, as :func:`checkfreq.pipeline.restore.copies.fetch_copies` sends it."""
        partners = ring(self.world, self.per_machine, self.replicas)
        return [self.report(rank, from_) for rank, (_, from_) in enumerate(partners)]

    def report(self, rank: int, senders: Sequence[int]) -> MemoryReport:
        if self.is_lost(rank):
            return MemoryReport([], None, {})
        held = [(step, COURSE) for step in STEPS]
        return MemoryReport(held, DISK_STEP, {sender: list(held) for sender in senders})


class KeptCopies(StateKeeper):
    """A tier that holds what :class:`Loss` says one rank holds: its snapshots' steps and its copies."""

    name = "kept copies"
    keeps_copies = True

    def snapshots(self, step: int | None = None, *, device_copies: bool = False) -> tuple[list[Any], list[Any]]:
        return [], []  # the copies' round only asks for holdings and copies

    def complete(self, state: Any) -> Any:
        return state

    def newest_step(self) -> int | None:
        return max((step for step, _ in self._report.steps), default=None)

    def forget_newer_than(self, step: int) -> None:
        pass

    def close(self, *, remove: bool, timeout: float | None = None) -> None:
        pass

    def release(self) -> None:
        pass

    def __init__(self, report: MemoryReport, copy_bytes: int) -> None:
        self._report, self._bytes = report, copy_bytes
        self.adopted: list[HeldCopy] = []

    def holdings(self) -> tuple[list[SnapshotKey], dict[int, list[SnapshotKey]]]:
        return list(self._report.steps), {rank: list(keys) for rank, keys in self._report.copies.items()}

    def read_copy(self, rank: int, key: SnapshotKey) -> HeldCopy:
        if key not in self._report.copies.get(rank, []):
            raise CheckfreqError(f"no copy of rank {rank}'s snapshot {key[0]} here")
        meta = b'{"step": %d}' % key[0]
        return HeldCopy(rank, key[0], meta, torch.zeros(self._bytes, dtype=torch.uint8), 1, b"s" * 16, key[1])

    def adopt(self, copy: HeldCopy) -> None:
        self.adopted.append(copy)


def plan_seconds(reports: Sequence[MemoryReport], repeats: int = 5) -> tuple[float, float]:
    """(median CPU seconds of rank 0's ``fetch_plan`` over ``reports``, of decoding them from the wire)."""
    wires = [report.to_wire() for report in reports]
    plans, decodes = [], []
    for _ in range(repeats):
        began = time.thread_time()
        decoded = [MemoryReport.from_wire(wire) for wire in wires]
        decodes.append(time.thread_time() - began)
        began = time.thread_time()
        fetch_plan(decoded)
        plans.append(time.thread_time() - began)
    return statistics.median(plans), statistics.median(decodes)
