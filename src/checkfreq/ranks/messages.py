"""The messages of the ranks' start-up, each a typed value with one encoder and one decoder
(:class:`~checkfreq.ranks.collectives.Message`).

On the wire each is the plain JSON value it always was (a string, a number, a small object), so a
typed message costs no byte more than the raw value did.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from checkfreq.ranks.collectives import JSON


@dataclass(frozen=True)
class Token:
    """0 → every rank, at start-up: the token naming this job's staging locations."""

    token: str

    def to_wire(self) -> JSON:
        return self.token

    @classmethod
    def from_wire(cls, wire: JSON) -> Token:
        return cls(str(wire))


@dataclass(frozen=True)
class DirectoryKey:
    """Rank → 0, at start-up: the key of this rank's local checkpoint directory, the same on every
    rank that sees that directory (:func:`checkfreq.ranks.sharing.directory_key`)."""

    key: str

    def to_wire(self) -> JSON:
        return self.key

    @classmethod
    def from_wire(cls, wire: JSON) -> DirectoryKey:
        return cls(str(wire))


@dataclass(frozen=True)
class DirectoryLeader:
    """0 → a rank, at start-up: the lowest rank whose local directory is this rank's."""

    rank: int

    def to_wire(self) -> JSON:
        return self.rank

    @classmethod
    def from_wire(cls, wire: JSON) -> DirectoryLeader:
        return cls(int(wire))


@dataclass(frozen=True)
class GroupMembers:
    """0 → a rank, at start-up: the ranks whose memory tier shares this rank's machine and run, in
    rank order (:func:`checkfreq.ranks.sharing.memory_group`), and, with replicas, the ranks on
    other machines it copies its snapshots to and the ranks whose snapshots it keeps."""

    ranks: list[int]
    sends_to: list[int] = field(default_factory=list)
    receives_from: list[int] = field(default_factory=list)

    def to_wire(self) -> JSON:
        return {"ranks": list(self.ranks), "to": list(self.sends_to), "from": list(self.receives_from)}

    @classmethod
    def from_wire(cls, wire: JSON) -> GroupMembers:
        if not isinstance(wire, dict):
            raise ValueError(f"a group's members are an object, got {type(wire).__name__}")
        return cls(
            [int(r) for r in wire["ranks"]],
            [int(r) for r in wire.get("to") or []],
            [int(r) for r in wire.get("from") or []],
        )
