"""The memory tier: snapshots in a named shared-memory region that outlives the process.

One region per checkpoint directory and rank, a file under ``/dev/shm`` (or
``$CHECKFREQ_SHM_DIR``) named after the directory's absolute path
(:mod:`checkfreq.storage.shm_paths`), so a restarted job finds it and two jobs never share one.
The file is mapped once and reused for every snapshot.

Layout (little-endian)::

    [0, 4096)             region header, then one 128-byte header per slot
    slot i                HEADER_BYTES + i * slot_bytes: data (data_capacity) | metadata (meta_capacity)

Commit protocol of one snapshot (:meth:`MemoryRegion.begin`, then :meth:`MemoryRegion.commit`):
the slot's header is zeroed first, the data and metadata are copied in, and only then is the
header written: magic, sequence number, step, lengths, layout signature, a checksum of data and
metadata (xxh3-64 of 64 MiB chunks hashed in parallel, :mod:`checkfreq.storage.parallel_hash`), and
a checksum of the header itself. A process killed anywhere in between leaves that slot without a
valid header (or with one whose checksum does not match), and the other slots, which the protocol
never touches meanwhile, still hold the previous complete snapshots (two slots by default; three
with ``replicas=``: :data:`COPIED_SLOTS`). Reading copies a slot into private memory and verifies
its checksum on the copy, so a torn or bit-flipped snapshot is detected and skipped, never loaded.

A large snapshot may be committed before its checksum is known (``commit(..., checksum=False)``,
then :meth:`MemoryRegion.seal`): the header, written only once the copy is complete, is the
commit marker, and its checksum field says :data:`PENDING`; the checksum is computed afterwards,
off the training's critical path, and written into the header if the slot still holds that
snapshot. A pending snapshot is complete (the marker comes after the copy) but a bit flipped in
memory since cannot be detected until it is sealed.

Shared memory survives the process, not the node (see docs/storage.md). tmpfs allocates pages
lazily, so the region's pages are reserved with ``posix_fallocate`` up front: a full /dev/shm
fails at :meth:`MemoryRegion.reserve` with :class:`ShmCapacityError`, never with a SIGBUS in
the middle of a copy.

Slots that CUDA tensors are copied into (or restored from) are registered with the CUDA runtime
once (:meth:`MemoryRegion.pin_slot`, :mod:`checkfreq.storage.host_pinning`), so the copies run
asynchronously at the pinned bandwidth; the registration is undone before the region is unmapped
(:meth:`MemoryRegion.release`, and when it grows).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import struct
import threading
from dataclasses import astuple, dataclass, replace
from pathlib import Path

import torch
import xxhash

from checkfreq.errors import CheckfreqError
from checkfreq.storage.format import BLOCK_BYTES
from checkfreq.storage.host_pinning import HostRegistry
from checkfreq.storage.parallel_hash import chunked_xxh3
from checkfreq.storage.shm_paths import device_and_inode, region_path

log = logging.getLogger("checkfreq.shm")

SLOTS = 2
"""A region's slots by default: the newest snapshot and the one being written."""
COPIED_SLOTS = 3
"""A region's slots when snapshots are copied to other machines (``replicas=``): the two newest
snapshots and the one being written, so that the step every rank can restore from stays in memory
while copies lag a snapshot behind (docs/storage.md, "Copies that lag")."""
HEADER_BYTES = 4096
META_MIN_BYTES = 64 << 10
VERSION = 3  # 2: chunked checksums; 3: a course in each slot header
_REGION_MAGIC = b"CKFQSHMR"
_SLOT_MAGIC = b"CKFQSLOT"
_REGION = struct.Struct("<8sIIQQQQ")  # magic, version, slots, data capacity, meta capacity, directory st_dev, st_ino
_SLOT = struct.Struct("<8sQqQQ16sQQ")  # magic, sequence, step, data and meta bytes, layout signature, checksum, course
_CHECK = struct.Struct("<Q")  # xxh3-64 of the packed slot header
PENDING = 0
"""The checksum field of a committed snapshot whose checksum is not computed yet."""
_SLOT_HEADER_AT = 128
_SLOT_HEADER_STRIDE = 128


_ROOM_ADVICE = (
    "Give it room: a larger /dev/shm (docker run --shm-size=..., a Kubernetes emptyDir with medium: Memory "
    "and a sizeLimit, or mount -o remount,size=... /dev/shm), or CHECKFREQ_SHM_DIR=<a tmpfs with room>"
)


class ShmCapacityError(CheckfreqError):
    """The shared-memory filesystem has no room for the memory tier's region."""


@dataclass(frozen=True)
class SlotInfo:
    """The header of one committed snapshot in a region."""

    slot: int
    sequence: int
    step: int
    data_bytes: int
    meta_bytes: int
    signature: bytes
    checksum: int
    course: int = 0
    """The course of the run that took it (each restore starts another): with it, a step names one state."""


@dataclass(frozen=True)
class OpenSlot:
    """A slot opened by :meth:`MemoryRegion.begin` for one snapshot."""

    slot: int
    sequence: int
    data: torch.Tensor
    """The slot's data area (``uint8``, aligned for direct I/O)."""


def layout_signature(signature: object) -> bytes:
    """A 16-byte digest of a layout signature (names, dtypes, shapes)."""
    return xxhash.xxh3_128(repr(signature).encode()).digest()


def _align(n: int) -> int:
    return -(-n // BLOCK_BYTES) * BLOCK_BYTES


class MemoryRegion:
    """One rank's shared-memory region: ``slots`` snapshot slots and their headers.

    Opening adopts a region left by an earlier process on the same directory (a restart reads
    it, whatever its number of slots) and removes one that belongs to another directory
    incarnation or is not a region of this version (unless ``tidy`` is False: a look that changes
    nothing). Nothing is created until :meth:`reserve`, which makes one of ``slots`` slots.
    """

    def __init__(self, path: Path, identity: tuple[int, int], *, tidy: bool = True, slots: int = SLOTS) -> None:
        self.path = path
        self._wanted = slots
        self.slots = slots
        """The slots of the mapped region (an adopted one keeps its own number until it is made again)."""
        self._identity = identity
        self._map: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None
        self._data_capacity = 0
        self._meta_capacity = 0
        self._lock = threading.Lock()
        self._sequence = 0
        self._registry: HostRegistry | None = None
        self._pinned: dict[int, int] = {}  # slot -> registered address
        self._refused: set[int] = set()  # slots whose registration the platform refused, in this mapping
        self.mapping = 0
        """Counts the region's mappings: a view of a slot taken under another number points nowhere."""
        self.skipped: list[tuple[str, str]] = []
        """(slot, reason) of every snapshot :meth:`newest` found torn or damaged."""
        if path.exists():
            self._adopt(tidy)

    @classmethod
    def for_directory(cls, directory: str | os.PathLike[str], rank: int = 0, *, slots: int = SLOTS) -> MemoryRegion:
        return cls(region_path(directory, rank), device_and_inode(directory), slots=slots)

    @property
    def mapped(self) -> bool:
        return self._map is not None

    @property
    def nbytes(self) -> int:
        """Size of the region file (0 when none is mapped)."""
        return 0 if self._map is None else len(self._map)

    # ------------------------------------------------------------------ set-up

    def _adopt(self, tidy: bool) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError as e:
            log.warning("cannot open shared-memory region %s: %s; it is ignored", self.path, e.strerror)
            return
        try:
            size = os.fstat(fd).st_size
            raw = os.pread(fd, _REGION.size, 0)
            reason = self._foreign(raw, size)
            if reason is not None:
                if tidy:
                    log.info("removing shared-memory region %s: %s", self.path, reason)
                    self.path.unlink(missing_ok=True)
                return
            _, _, self.slots, self._data_capacity, self._meta_capacity, _, _ = _REGION.unpack(raw)
            self._map_fd(fd, size)
        finally:
            os.close(fd)
        self._sequence = max((info.sequence for info in self.snapshots()), default=0)

    def _foreign(self, raw: bytes, size: int) -> str | None:
        """Why an existing region file cannot be adopted, or None if it can."""
        if len(raw) < _REGION.size:
            return "it is truncated"
        magic, version, slots, data_cap, meta_cap, dev, ino = _REGION.unpack(raw)
        if magic != _REGION_MAGIC or version != VERSION or slots not in (SLOTS, COPIED_SLOTS):
            return "it is not a region of this checkfreq version"
        if (dev, ino) != self._identity:
            return "it was written for an earlier directory of the same name"
        if size != HEADER_BYTES + slots * (data_cap + meta_cap):
            return "its size does not match its header"
        return None

    def _map_fd(self, fd: int, size: int) -> None:
        populate = getattr(mmap, "MAP_POPULATE", 0)  # map every page now, not at the first copy
        self._map = mmap.mmap(fd, size, mmap.MAP_SHARED | populate, mmap.PROT_READ | mmap.PROT_WRITE)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.mapping += 1

    def reserve(self, data_bytes: int, meta_bytes: int) -> None:
        """Make sure every slot holds ``data_bytes`` of data and ``meta_bytes`` of metadata.

        Keeps the mapped region when it is large enough and has the slots asked for; otherwise
        replaces it (its snapshots are dropped) by one with room to spare for metadata that grows. Raises
        :class:`ShmCapacityError` if the shared-memory filesystem has no room (nothing is left
        behind then).
        """
        if self.fits(data_bytes, meta_bytes):
            return
        data_cap, meta_cap = _align(max(1, data_bytes)), _align(max(META_MIN_BYTES, 2 * meta_bytes))
        slots = self._wanted
        size = HEADER_BYTES + slots * (data_cap + meta_cap)
        self.release(remove=True)
        directory = self.path.parent
        try:
            stats = os.statvfs(directory)
        except OSError as e:
            raise ShmCapacityError(f"{directory} is not usable for the memory tier: {e.strerror}") from None
        free = stats.f_bavail * stats.f_frsize
        if free < size:
            raise ShmCapacityError(
                f"{directory} has {free / 2**20:.1f} MiB free; the memory tier needs {size / 2**20:.1f} MiB "
                f"({slots} snapshots of {data_bytes / 2**20:.1f} MiB). {_ROOM_ADVICE}"
            )
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # tmpfs reserves the pages now: no SIGBUS later
            os.pwrite(fd, _REGION.pack(_REGION_MAGIC, VERSION, slots, data_cap, meta_cap, *self._identity), 0)
            self._data_capacity, self._meta_capacity, self.slots = data_cap, meta_cap, slots
            self._map_fd(fd, size)
        except OSError as e:
            self.path.unlink(missing_ok=True)
            if e.errno in (errno.ENOSPC, errno.ENOMEM):
                raise ShmCapacityError(
                    f"{directory} ran out of space reserving {size / 2**20:.1f} MiB for the memory tier. {_ROOM_ADVICE}"
                ) from None
            raise
        finally:
            os.close(fd)
        self._sequence = 0
        log.info("memory tier: %s, %d slots of %.1f MiB", self.path, slots, data_cap / 2**20)

    def fits(self, data_bytes: int, meta_bytes: int) -> bool:
        """Whether :meth:`reserve` would keep the mapping (and its registrations) as it is."""
        return (
            self._map is not None
            and self.slots == self._wanted
            and data_bytes <= self._data_capacity
            and meta_bytes <= self._meta_capacity
        )

    def pin_slot(self, slot: int, registry: HostRegistry) -> bool:
        """Register ``slot``'s data area with ``registry`` (once per mapping: a no-op if it is
        registered already); False if the platform refused and the slot stays pageable (asked once
        per mapping: a refusal is not retried at every snapshot)."""
        assert self._bytes is not None
        if slot in self._pinned:
            return True
        if slot in self._refused:
            return False
        self._registry = registry
        address = self.slot_data(slot).data_ptr()
        if not registry.register(address, self._data_capacity):
            self._refused.add(slot)
            return False
        self._pinned[slot] = address
        return True

    @property
    def pinned_slots(self) -> frozenset[int]:
        """The slots registered for device copies in the current mapping."""
        return frozenset(self._pinned)

    def _unpin_all(self) -> None:
        """Undo every registration: before the mapping goes (a registered range must never be unmapped)."""
        registry, pinned, self._pinned, self._refused = self._registry, self._pinned, {}, set()
        for address in pinned.values():
            assert registry is not None
            registry.unregister(address)

    def release(self, *, remove: bool) -> None:
        """Unmap the region (its slots unregistered first); with ``remove``, delete its file too."""
        self._unpin_all()
        self._bytes = None
        self.mapping += 1
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a memoryview export is alive: the mapping goes with it (tensor views hold none)
                pass
            self._map = None
        if remove:
            self.path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ headers

    def _header_at(self, slot: int) -> int:
        return _SLOT_HEADER_AT + slot * _SLOT_HEADER_STRIDE

    def _data_at(self, slot: int) -> int:
        return HEADER_BYTES + slot * (self._data_capacity + self._meta_capacity)

    def slot_data(self, slot: int) -> torch.Tensor:
        """The slot's data area, a tensor of its own storage starting at the slot (so that
        ``is_pinned()``, which asks about a storage's start, sees the slot's registration)."""
        assert self._map is not None
        return torch.frombuffer(self._map, dtype=torch.uint8, count=self._data_capacity, offset=self._data_at(slot))

    def header(self, slot: int) -> SlotInfo | None:
        """The slot's committed header, or None if it has none or it is damaged."""
        assert self._map is not None
        at = self._header_at(slot)
        raw = self._map[at : at + _SLOT.size + _CHECK.size]
        body, (check,) = raw[: _SLOT.size], _CHECK.unpack(raw[_SLOT.size :])
        if xxhash.xxh3_64_intdigest(body) != check:
            return None
        magic, sequence, step, data_bytes, meta_bytes, signature, checksum, course = _SLOT.unpack(body)
        if magic != _SLOT_MAGIC or data_bytes > self._data_capacity or meta_bytes > self._meta_capacity:
            return None
        return SlotInfo(slot, sequence, step, data_bytes, meta_bytes, signature, checksum, course)

    def snapshots(self) -> list[SlotInfo]:
        """Slots with a valid header, newest first (their data is not verified here)."""
        if self._map is None:
            return []
        found = [info for slot in range(self.slots) if (info := self.header(slot)) is not None]
        return sorted(found, key=lambda info: -info.sequence)

    # ------------------------------------------------------------------ write

    def begin(self, keep: int | None = None) -> OpenSlot:
        """Open a slot for the next snapshot: its header is invalidated before this returns.

        The slot chosen is never ``keep`` (a slot still being persisted to disk): a slot without a
        snapshot if there is one, else the oldest snapshot's, which, when there is a choice, is
        not one of the newest ``slots - 1`` (:meth:`spare`). The sequence number is drawn here, so
        snapshots rank in the order they were taken whichever thread commits them.
        """
        assert self._map is not None and self._bytes is not None
        slot = self._overwritten(keep)
        at = self._header_at(slot)
        with self._lock:  # a seal never writes a header that begin() has invalidated
            self._map[at : at + _SLOT_HEADER_STRIDE] = bytes(_SLOT_HEADER_STRIDE)
            self._sequence += 1
            sequence = self._sequence
        return OpenSlot(slot, sequence, self.slot_data(slot))

    def spare(self, keep: int | None = None) -> bool:
        """Whether :meth:`begin` (never opening ``keep``) has a slot that holds none of the newest
        ``slots - 1`` snapshots."""
        return self._overwritten(keep) not in self._newest_slots()

    def _newest_slots(self) -> set[int]:
        return {info.slot for info in self.snapshots()[: self.slots - 1]}

    def _overwritten(self, keep: int | None) -> int:
        """The slot :meth:`begin` opens: an empty one, else the oldest snapshot's, never ``keep``."""
        held = {info.slot: info.sequence for info in self.snapshots()}
        free = sorted((s for s in range(self.slots) if s != keep), key=lambda s: held.get(s, -1))
        newest = self._newest_slots()
        return next((s for s in free if s not in newest), free[0])

    def commit(
        self,
        target: OpenSlot,
        step: int,
        data_bytes: int,
        meta: bytes,
        signature: bytes,
        *,
        checksum: bool = True,
        expect: int | None = None,
        course: int = 0,
    ) -> SlotInfo:
        """Publish the snapshot copied into ``target``: metadata, then checksum, then header (last).

        Without ``checksum`` the header says :data:`PENDING`; :meth:`seal` adds the checksum later.
        With ``expect`` (a copy of another slot: a replica) the checksum must be that slot's, else
        :class:`ShmSnapshotError` and the slot stays without a header.
        """
        assert self._map is not None
        if len(meta) > self._meta_capacity or data_bytes > self._data_capacity:
            raise ValueError("snapshot does not fit the reserved slot")
        start = self._data_at(target.slot)
        meta_at = start + self._data_capacity
        self._map[meta_at : meta_at + len(meta)] = meta
        digest = self._checksum(start, data_bytes, meta_at, len(meta)) if checksum else PENDING
        if expect is not None and digest != expect:
            raise ShmSnapshotError(f"the copy of step {step} does not match its sender's checksum: damaged on the way")
        info = SlotInfo(target.slot, target.sequence, step, data_bytes, len(meta), signature, digest, course)
        self._write_header(info)
        return info

    def seal(self, info: SlotInfo) -> SlotInfo | None:
        """Compute the checksum of a snapshot committed :data:`PENDING` and write it into its header;
        None (nothing written) if the slot has since been reopened for another snapshot."""
        if self._map is None or self.header(info.slot) != info:
            return None
        start = self._data_at(info.slot)
        digest = self._checksum(start, info.data_bytes, start + self._data_capacity, info.meta_bytes)
        sealed = replace(info, checksum=digest)
        with self._lock:
            if self._map is None or self.header(info.slot) != info:
                return None
            self._write_header(sealed)
        return sealed

    def _write_header(self, info: SlotInfo) -> None:
        assert self._map is not None
        body = _SLOT.pack(_SLOT_MAGIC, *astuple(info)[1:])  # the header's fields in order, but the slot
        at = self._header_at(info.slot)
        self._map[at : at + _SLOT.size + _CHECK.size] = body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))

    def clear(self) -> None:
        """Invalidate every snapshot (the run went back to an older state: they are another timeline)."""
        with self._lock:  # a seal checks and writes a header under it: it never brings one back
            if self._map is not None:
                for slot in range(self.slots):
                    at = self._header_at(slot)
                    self._map[at : at + _SLOT_HEADER_STRIDE] = bytes(_SLOT_HEADER_STRIDE)

    def _checksum(self, data_at: int, data_bytes: int, meta_at: int, meta_bytes: int) -> int:
        view = memoryview(self._map)  # type: ignore[arg-type]
        try:
            return slot_digest(view[data_at : data_at + data_bytes], bytes(view[meta_at : meta_at + meta_bytes]))
        finally:
            view.release()

    # ------------------------------------------------------------------ read

    def read(self, info: SlotInfo, *, private: bool = True) -> tuple[bytes, torch.Tensor]:
        """Verify a committed snapshot and return it: (metadata, data).

        With ``private`` the data is copied first and the copy verified, so that a snapshot
        another process is writing can never pass (a look from outside, such as ``checkfreq
        ls``). Without, the data is a view of the region, verified in place: for the region's
        owner, which writes nothing while it reads. Raises :class:`ShmSnapshotError` if the
        checksum does not match.
        """
        assert self._bytes is not None
        start = self._data_at(info.slot)
        data = self.slot_data(info.slot)[: info.data_bytes]
        if private:
            data = data.clone()
        meta_at = start + self._data_capacity
        meta = bytes(self._map[meta_at : meta_at + info.meta_bytes])  # type: ignore[index]
        pending = info.checksum == PENDING  # committed after its copy, checksum not computed yet
        if (not pending and slot_digest(data.numpy().data, meta) != info.checksum) or self.header(info.slot) != info:
            raise ShmSnapshotError(f"slot {info.slot} (step {info.step}) fails its checksum: torn or damaged")
        return meta, data

    def slot_bytes(self, info: SlotInfo) -> tuple[torch.Tensor, bytes]:
        """The data (a view of the region) and metadata of a committed snapshot, unverified: for a
        copy the receiver verifies against ``info.checksum``."""
        assert self._map is not None
        meta_at = self._data_at(info.slot) + self._data_capacity
        return self.slot_data(info.slot)[: info.data_bytes], bytes(self._map[meta_at : meta_at + info.meta_bytes])

    def newest(self, step: int | None = None, course: int | None = None) -> tuple[SlotInfo, bytes, torch.Tensor] | None:
        """The newest snapshot (or the one at ``step``, of ``course``) that verifies; damaged ones are
        skipped with a warning and listed in :attr:`skipped`."""
        self.skipped = []
        for info in self.snapshots():
            if (step is not None and info.step != step) or (course is not None and info.course != course):
                continue
            try:
                meta, data = self.read(info)
            except ShmSnapshotError as e:
                log.warning("skipping memory snapshot: %s", e)
                self.skipped.append((f"memory slot {info.slot}", str(e)))
                continue
            return info, meta, data
        return None


def slot_digest(data: memoryview, meta: bytes) -> int:
    """A slot's checksum: never :data:`PENDING` (a 2**-64 chance, made 1)."""
    return chunked_xxh3(data, meta) or 1


class ShmSnapshotError(CheckfreqError):
    """A memory-tier snapshot is torn or damaged (its checksum does not match)."""
