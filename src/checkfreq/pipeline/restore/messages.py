"""The restore's messages between the ranks, each a typed value with one encoder and one decoder.

On the wire every message is plain JSON (lists, not tuples), whatever the transport: a world of one
passes the encoded value to itself, so both paths decode the same thing. Each class is a
:class:`~checkfreq.ranks.collectives.Message`: ``to_wire`` encodes it, its ``from_wire`` decodes it.
The three orders rank 0 scatters (:data:`Order`) are told apart by their tag, the one key only
that kind has (:func:`decode_order`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

from checkfreq.pipeline.tiers.roles import SnapshotKey
from checkfreq.ranks.collectives import JSON

ALL_FILES = "all"
"""``Holdings.held`` for a directory that holds every data file of the checkpoint."""


def _keys(wire: JSON) -> list[SnapshotKey]:
    return [(int(step), int(course)) for step, course in wire]


@dataclass
class MemoryReport:
    """Rank → 0: the memory snapshots this rank holds (step and course), the newest step its disk tiers
    list, and (with ``replicas=``) the copies of other ranks' snapshots its machine keeps, by rank."""

    steps: list[SnapshotKey]
    disk: int | None
    copies: dict[int, list[SnapshotKey]] = field(default_factory=dict)

    def to_wire(self) -> JSON:
        copies = {str(r): [list(key) for key in keys] for r, keys in self.copies.items()}
        return {"steps": [list(key) for key in self.steps], "disk": self.disk, "copies": copies}

    @classmethod
    def from_wire(cls, wire: JSON) -> MemoryReport:
        copies = {int(r): _keys(keys) for r, keys in (wire.get("copies") or {}).items()}
        return cls(_keys(wire["steps"]), None if wire["disk"] is None else int(wire["disk"]), copies)


@dataclass
class FetchPlan:
    """0 → every rank: the memory snapshot (step and course; step None: none) that the ranks which lost
    theirs take from the copies other ranks keep, as (rank, a rank keeping its copy) pairs, each rank's
    keepers in the order they are tried; after a copy no keeper could give, what the restore does
    ``instead`` (for the log)."""

    step: int | None
    pairs: list[tuple[int, int]]
    instead: str = ""
    course: int = 0

    def to_wire(self) -> JSON:
        pairs = [list(p) for p in self.pairs]
        return {"step": self.step, "pairs": pairs, "instead": self.instead, "course": self.course}

    @classmethod
    def from_wire(cls, wire: JSON) -> FetchPlan:
        step = wire["step"]
        return cls(
            None if step is None else int(step),
            [(int(r), int(h)) for r, h in wire["pairs"]],
            str(wire.get("instead", "")),
            int(wire.get("course", 0)),
        )


@dataclass
class NewestStep:
    """Rank → 0, then 0 → every rank, at start-up: the newest step a rank's tiers list or hold, then
    the newest of every rank's (None: none) with the course rank 0 drew for the run's snapshots
    (:mod:`checkfreq.pipeline.restore.course`)."""

    step: int | None
    course: int = 0

    def to_wire(self) -> JSON:
        return [self.step, self.course]

    @classmethod
    def from_wire(cls, wire: JSON) -> NewestStep:
        step, course = wire
        return cls(None if step is None else int(step), int(course))


@dataclass
class MemoryChoice:
    """0 → every rank: the memory snapshot to restore, its step and course (None: none, restore from
    disk), and whether every rank holds some snapshot."""

    best: SnapshotKey | None
    common: bool

    def to_wire(self) -> JSON:
        return [None if self.best is None else list(self.best), self.common]

    @classmethod
    def from_wire(cls, wire: JSON) -> MemoryChoice:
        best, common = wire
        return cls(None if best is None else _keys([best])[0], bool(common))


@dataclass
class ListedSteps:
    """Rank → 0: the steps of the committed checkpoints this rank's tiers list, newest first."""

    steps: list[int]

    def to_wire(self) -> JSON:
        return self.steps

    @classmethod
    def from_wire(cls, wire: JSON) -> ListedSteps:
        return cls([int(s) for s in wire])


@dataclass
class Agenda:
    """0 → every rank: the steps every rank lists, newest first; why each other step is passed over;
    and whether any rank lists any checkpoint."""

    steps: list[int]
    passed: dict[int, str]
    listed: bool

    def to_wire(self) -> JSON:
        return {"steps": self.steps, "passed": [[s, why] for s, why in self.passed.items()], "listed": self.listed}

    @classmethod
    def from_wire(cls, wire: JSON) -> Agenda:
        return cls([int(s) for s in wire["steps"]], {int(s): why for s, why in wire["passed"]}, bool(wire["listed"]))


@dataclass
class Holdings:
    """What a rank has of one checkpoint, as rank 0 plans the restore with it."""

    held: str | list[str] | None
    """The data files its directory holds (:data:`ALL_FILES` for every one); None on a rank that is not
    its directory's leader (rank 0 takes the leader's answer)."""
    remote: bool
    """A far tier (the remote tier) lists the checkpoint."""
    cache: int | None
    """Ranks with the same value read their directory through one page cache; None: no sharing."""
    directory_leader: int
    """Ranks with the same value share one local directory (its lowest rank)."""
    files: str
    """A digest of the data files the manifest lists (every rank must read the same manifest)."""
    needs: list[int] | None
    """The saved ranks whose data files this rank needs whole; None for every file."""

    def holds(self, name: str) -> bool:
        return self.held == ALL_FILES or (self.held is not None and name in self.held)

    def to_wire(self) -> JSON:
        return {
            "held": self.held,
            "remote": self.remote,
            "cache": self.cache,
            "dir": self.directory_leader,
            "files": self.files,
            "needs": self.needs,
        }

    @classmethod
    def from_wire(cls, wire: JSON) -> Holdings:
        return cls(wire["held"], wire["remote"], wire["cache"], wire["dir"], wire["files"], wire["needs"])


@dataclass
class CheckpointView:
    """Rank → 0: what this rank has of one checkpoint, or why it cannot read the checkpoint's manifest.
    On the wire: the holdings, or the reason (a string)."""

    view: Holdings | str

    def to_wire(self) -> JSON:
        return self.view if isinstance(self.view, str) else self.view.to_wire()

    @classmethod
    def from_wire(cls, wire: JSON) -> CheckpointView:
        return cls(wire if isinstance(wire, str) else Holdings.from_wire(wire))


class ReadFrom(str, Enum):
    """Where a reader reads a data file from, in the restore's read orders."""

    DIRECTORY = "directory"
    """The reader's own directory: the tier every persist commits to."""
    FAR = "far"
    """The first far tier (the remote tier) that lists the checkpoint."""


@dataclass
class ReadOrder:
    """0 → a rank: read and verify these files, each from its tier; pack their replicated pieces."""

    TAG: ClassVar[str] = "read"

    read: list[tuple[str, ReadFrom]]
    """(data file, where to read it)."""
    pack: bool

    def to_wire(self) -> JSON:
        return {"read": [[name, where.value] for name, where in self.read], "pack": self.pack}

    @classmethod
    def from_wire(cls, wire: JSON) -> ReadOrder:
        return cls([(str(name), ReadFrom(where)) for name, where in wire["read"]], bool(wire["pack"]))


@dataclass
class ExchangeOrder:
    """0 → a rank, once every file is verified: what it maps, receives and sends, in how many rounds
    it all-gathers the replicated pieces, and whether it gets only some files."""

    TAG: ClassVar[str] = "map"

    map: list[str]
    receive: list[tuple[str, int]]
    """(data file, the rank that sends it)."""
    send: list[tuple[str, int]]
    """(data file, the rank it goes to)."""
    stream: int
    partial: bool

    def to_wire(self) -> JSON:
        return {
            "map": self.map,
            "receive": [list(r) for r in self.receive],
            "send": [list(s) for s in self.send],
            "stream": self.stream,
            "partial": self.partial,
        }

    @classmethod
    def from_wire(cls, wire: JSON) -> ExchangeOrder:
        return cls(
            [str(name) for name in wire["map"]],
            [(str(name), int(r)) for name, r in wire["receive"]],
            [(str(name), int(r)) for name, r in wire["send"]],
            int(wire["stream"]),
            bool(wire["partial"]),
        )


@dataclass
class Refusal:
    """0 → every rank: the ranks cannot restore this checkpoint, and why."""

    TAG: ClassVar[str] = "problem"

    problem: str

    def to_wire(self) -> JSON:
        return {"problem": self.problem}

    @classmethod
    def from_wire(cls, wire: JSON) -> Refusal:
        return cls(str(wire["problem"]))


Order = ReadOrder | ExchangeOrder | Refusal
ORDERS: tuple[type[ReadOrder], type[ExchangeOrder], type[Refusal]] = (ReadOrder, ExchangeOrder, Refusal)
"""Every kind of order, each with its tag: the key of its wire form that no other kind has."""


def decode_order(wire: JSON) -> Order:
    """The order a rank received from rank 0: the one kind whose tag its wire form holds."""
    kinds = [kind for kind in ORDERS if isinstance(wire, dict) and kind.TAG in wire]
    if len(kinds) != 1:
        raise ValueError(f"not an order of rank 0's: {wire!r:.200}")
    return kinds[0].from_wire(wire)


@dataclass
class DamageReport:
    """Rank → 0, after reading its files: why each damaged one is (none: every file verified)."""

    damaged: dict[str, str]

    def to_wire(self) -> JSON:
        return self.damaged

    @classmethod
    def from_wire(cls, wire: JSON) -> DamageReport:
        return cls({str(name): str(why) for name, why in wire.items()})


@dataclass
class FileTransfer:
    """Rank → rank, before the bytes of a data file it sends whole: the file's parsed header and its
    data section's size."""

    header: dict[str, Any]
    size: int

    def to_wire(self) -> JSON:
        return {"header": self.header, "size": self.size}

    @classmethod
    def from_wire(cls, wire: JSON) -> FileTransfer:
        return cls(wire["header"], int(wire["size"]))


@dataclass
class ExchangeOutcome:
    """Rank → 0, after the exchange of a checkpoint read in part: this rank's error, and the first
    sharded tensor whose block its files fall short of (each None if none)."""

    problem: str | None
    short: str | None

    def to_wire(self) -> JSON:
        return [self.problem, self.short]

    @classmethod
    def from_wire(cls, wire: JSON) -> ExchangeOutcome:
        problem, short = wire
        return cls(problem, short)


@dataclass
class ExchangeVerdict:
    """0 → every rank, after :class:`ExchangeOutcome`: every rank's error, and the first rank whose
    files fall short of its blocks, with the tensor (None: none does)."""

    errors: list[str]
    short_of: tuple[int, str] | None

    def to_wire(self) -> JSON:
        return [self.errors, None if self.short_of is None else list(self.short_of)]

    @classmethod
    def from_wire(cls, wire: JSON) -> ExchangeVerdict:
        errors, short_of = wire
        return cls([str(e) for e in errors], None if short_of is None else (int(short_of[0]), str(short_of[1])))


@dataclass(frozen=True)
class CopyTransfer:
    """Keeper → rank, at the restore's first round (``replicas=``), before the bytes of the copy of the
    rank's snapshot it keeps (its manifest, then its data): their sizes, the copy's checksum and layout
    signature, and the keeper's host (for the log)."""

    meta: int
    data: int
    checksum: int
    """The copy's xxh3-64 checksum (unsigned), as it was kept."""
    signature: bytes
    """The snapshot's layout signature (hex on the wire)."""
    host: str

    def to_wire(self) -> JSON:
        return {
            "meta": self.meta,
            "data": self.data,
            "checksum": self.checksum,
            "signature": self.signature.hex(),
            "host": self.host,
        }

    @classmethod
    def from_wire(cls, wire: JSON) -> CopyTransfer:
        return cls(
            int(wire["meta"]),
            int(wire["data"]),
            int(wire["checksum"]),
            bytes.fromhex(wire["signature"]),
            str(wire["host"]),
        )


@dataclass(frozen=True)
class CopyUnreadable:
    """Keeper → rank, in place of a :class:`CopyTransfer`: why it cannot read the copy it keeps (no bytes
    follow), and its host."""

    TAG: ClassVar[str] = "error"

    error: str
    host: str

    def to_wire(self) -> JSON:
        return {"error": self.error, "host": self.host}

    @classmethod
    def from_wire(cls, wire: JSON) -> CopyUnreadable:
        return cls(str(wire["error"]), str(wire["host"]))


def decode_copy_transfer(wire: JSON) -> CopyTransfer | CopyUnreadable:
    """What a keeper sent before a copy: its transfer, or why it has none (the one with :attr:`CopyUnreadable.TAG`)."""
    if isinstance(wire, dict) and CopyUnreadable.TAG in wire:
        return CopyUnreadable.from_wire(wire)
    return CopyTransfer.from_wire(wire)
