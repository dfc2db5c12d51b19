"""The restore's messages between the ranks, each a typed value with one encoder and one decoder.

On the wire every message is plain JSON (lists, not tuples), whatever the transport: a world of one
passes the encoded value to itself, so both paths decode the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ALL_FILES = "all"
"""``Summary.held`` for a directory that holds every data file of the checkpoint."""


@dataclass
class MemoryReport:
    """Rank → 0: the memory snapshots this rank holds, and the newest step its disk tiers list."""

    steps: list[int]
    disk: int | None

    def to_wire(self) -> dict[str, Any]:
        return {"steps": self.steps, "disk": self.disk}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> MemoryReport:
        return cls(list(wire["steps"]), wire["disk"])


@dataclass
class Agenda:
    """0 → every rank: the steps every rank lists, newest first; why each other step is passed over;
    and whether any rank lists any checkpoint."""

    steps: list[int]
    passed: dict[int, str]
    listed: bool

    def to_wire(self) -> dict[str, Any]:
        return {"steps": self.steps, "passed": [[s, why] for s, why in self.passed.items()], "listed": self.listed}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Agenda:
        return cls(list(wire["steps"]), {int(s): why for s, why in wire["passed"]}, bool(wire["listed"]))


@dataclass
class Summary:
    """Rank → 0: what this rank has of one checkpoint."""

    held: str | list[str] | None
    """The data files its directory holds (:data:`ALL_FILES` for every one); None on a rank that is not
    its directory's leader (rank 0 takes the leader's answer)."""
    remote: bool
    """The remote tier lists the checkpoint."""
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

    def to_wire(self) -> dict[str, Any]:
        return {"held": self.held, "remote": self.remote, "cache": self.cache, "dir": self.directory_leader,
                "files": self.files, "needs": self.needs}

    @classmethod
    def from_wire(cls, wire: dict[str, Any] | str) -> Summary | str:
        """The summary, or a rank's reason it cannot read the checkpoint's manifest."""
        if isinstance(wire, str):
            return wire
        return cls(wire["held"], wire["remote"], wire["cache"], wire["dir"], wire["files"], wire["needs"])


@dataclass
class ReadOrder:
    """0 → a rank: read and verify these files, each from its tier; pack their replicated pieces."""

    read: list[tuple[str, str]]
    """(data file, ``"local"`` or ``"remote"``)."""
    pack: bool

    def to_wire(self) -> dict[str, Any]:
        return {"read": [[name, tier] for name, tier in self.read], "pack": self.pack}


@dataclass
class ExchangeOrder:
    """0 → a rank, once every file is verified: what it maps, receives and sends, in how many rounds
    it all-gathers the replicated pieces, and whether it gets only some files."""

    map: list[str]
    receive: list[tuple[str, int]]
    """(data file, the rank that sends it)."""
    send: list[tuple[str, int]]
    """(data file, the rank it goes to)."""
    stream: int
    partial: bool

    def to_wire(self) -> dict[str, Any]:
        return {"map": self.map, "receive": [list(r) for r in self.receive], "send": [list(s) for s in self.send],
                "stream": self.stream, "partial": self.partial}


@dataclass
class Refusal:
    """0 → every rank: the ranks cannot restore this checkpoint, and why."""

    problem: str

    def to_wire(self) -> dict[str, Any]:
        return {"problem": self.problem}


Order = ReadOrder | ExchangeOrder | Refusal


def decode_order(wire: dict[str, Any]) -> Order:
    """The order a rank received from rank 0."""
    if "problem" in wire:
        return Refusal(wire["problem"])
    if "read" in wire:
        return ReadOrder([(name, tier) for name, tier in wire["read"]], bool(wire["pack"]))
    return ExchangeOrder(list(wire["map"]), [(name, int(r)) for name, r in wire["receive"]],
                         [(name, int(r)) for name, r in wire["send"]], int(wire["stream"]), bool(wire["partial"]))
