"""Small JSON messages between ranks (and, at restore, whole files sent from one rank to another
and the replicated tensors all-gathered in rows of one tensor), and the same calls for a world of one.

The commit, upload and restore protocols are written once against :class:`Peers`: under
``torch.distributed`` a :class:`GroupPeers` carries the messages over a dedicated gloo group; a
single process is a :class:`Solo` world, where every collective returns at once. Messages are
JSON, never pickles.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Protocol

import torch
import torch.distributed as dist


class Peers(Protocol):
    """The ranks taking part in one protocol, seen from one of them."""

    rank: int
    size: int

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's JSON-able ``value``, in rank order."""
        ...

    def gather(self, value: Any) -> list[Any] | None:
        """On rank 0, every rank's JSON-able ``value`` in rank order; None on the other ranks."""
        ...

    def broadcast(self, value: Any) -> Any:
        """Rank 0's JSON-able ``value`` on every rank (other ranks pass anything)."""
        ...

    def all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """Every rank's flat ``uint8`` tensor ``row`` (the same length on every rank), one row per
        rank in rank order: an ``(N, len(row))`` tensor."""
        ...

    def send(self, payload: torch.Tensor, to: int) -> None:
        """Send the flat ``uint8`` tensor ``payload`` to rank ``to``, which receives it with
        :meth:`receive` (blocks until it does)."""
        ...

    def receive(self, size: int, sender: int) -> torch.Tensor:
        """The ``size`` bytes (a flat ``uint8`` tensor) rank ``sender`` sends with :meth:`send`."""
        ...


class Solo:
    """A world of one process: every collective is the identity."""

    rank = 0
    size = 1

    def all_gather(self, value: Any) -> list[Any]:
        return [json.loads(json.dumps(value))]

    def gather(self, value: Any) -> list[Any] | None:
        return [json.loads(json.dumps(value))]

    def broadcast(self, value: Any) -> Any:
        return json.loads(json.dumps(value))

    def all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        return row.reshape(1, -1)

    def send(self, payload: torch.Tensor, to: int) -> None:
        raise RuntimeError("a world of one has no other rank to send to")

    def receive(self, size: int, sender: int) -> torch.Tensor:
        raise RuntimeError("a world of one has no other rank to receive from")


class GroupPeers:
    """The ranks of a gloo process group (the group's rank 0 is the sender of broadcasts)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def all_gather(self, value: Any) -> list[Any]:
        return all_gather_json(value, self.group)

    def gather(self, value: Any) -> list[Any] | None:
        return gather_json(value, self.group)

    def broadcast(self, value: Any) -> Any:
        return broadcast_json(value, self.group)

    def all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        rows = torch.empty(self.size, row.numel(), dtype=torch.uint8)
        _all_gather_single(rows.view(-1), row, group=self.group)
        return rows

    def send(self, payload: torch.Tensor, to: int) -> None:
        if payload.numel():
            dist.send(payload, group=self.group, group_dst=to)

    def receive(self, size: int, sender: int) -> torch.Tensor:
        buffer = torch.empty(size, dtype=torch.uint8)
        if size:
            dist.recv(buffer, group=self.group, group_src=sender)
        return buffer


def broadcast_json(value: Any, group: Any) -> Any:
    """Rank 0's JSON-able ``value`` on every rank of ``group`` (no pickling)."""
    is_source = dist.get_rank() == dist.get_global_rank(group, 0)
    payload = _encode(value) if is_source else torch.empty(0, dtype=torch.uint8)
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    dist.broadcast(length, group=group, group_src=0)
    if not is_source:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(payload, group=group, group_src=0)
    return _decode(payload)


def gather_json(value: Any, group: Any) -> list[Any] | None:
    """Every rank's JSON-able ``value``, in rank order, on the group's rank 0; None on the others.

    Point to point: each other rank sends its length and its message to rank 0 (it sends and
    receives nothing else), which receives them from all ranks at once.
    """
    payload = _encode(value)
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    size = dist.get_world_size(group)
    if dist.get_rank(group) != 0:
        dist.send(length, group=group, group_dst=0)
        dist.send(payload, group=group, group_dst=0)
        return None
    lengths = [length] + [torch.zeros(1, dtype=torch.int64) for _ in range(1, size)]
    _wait_all([dist.irecv(lengths[r], group=group, group_src=r) for r in range(1, size)])
    payloads = [payload] + [torch.empty(int(lengths[r].item()), dtype=torch.uint8) for r in range(1, size)]
    _wait_all([dist.irecv(payloads[r], group=group, group_src=r) for r in range(1, size)])
    return [_decode(p) for p in payloads]


def _wait_all(works: list[Any]) -> None:
    """Wait for point-to-point receives posted together (each a ``Work``)."""
    for work in works:
        work.wait()


def collect_errors(peers: Peers, error: str | None) -> list[str]:
    """Every rank's error (None: it has none), the same list on every rank.

    Gathered on rank 0 and broadcast back: a rank other than 0 sends and receives a few bytes when
    no rank failed, whatever the number of ranks.
    """
    gathered = peers.gather(error)
    return peers.broadcast(None if gathered is None else [e for e in gathered if e])


TREE_ARITY = 8
"""Children per rank in :func:`tree_max`'s tree: rank ``r``'s parent is ``(r - 1) // TREE_ARITY``."""


def tree_max(peers: Peers, value: torch.Tensor) -> torch.Tensor:
    """The elementwise maximum of every rank's ``value`` (an int64 vector of the same length on every
    rank), on every rank.

    Reduced up a tree of the ranks (rank ``r``'s children are ``TREE_ARITY * r + 1`` to
    ``TREE_ARITY * r + TREE_ARITY``) and sent back down, point to point only: a rank receives at
    most ``TREE_ARITY + 1`` messages and sends as many, whatever the number of ranks, and the
    result reaches every rank after ``O(TREE_ARITY * log N)`` message latencies.
    """
    result = value.to(torch.int64).flatten().clone()
    width = result.numel() * result.element_size()
    first = TREE_ARITY * peers.rank + 1
    children = range(first, min(first + TREE_ARITY, peers.size))
    for child in children:
        result = torch.maximum(result, peers.receive(width, child).view(torch.int64))
    if peers.rank:
        parent = (peers.rank - 1) // TREE_ARITY
        peers.send(result.view(torch.uint8), parent)
        result = peers.receive(width, parent).view(torch.int64)
    for child in children:
        peers.send(result.view(torch.uint8), child)
    return result


def scatter_json(peers: Peers, values: list[Any] | None) -> Any:
    """Rank 0's ``values[r]`` on each rank ``r`` (other ranks pass None): rank 0 sends each rank its
    own value, point to point, so a rank other than 0 receives one message whatever the number of ranks."""
    if peers.rank != 0:
        return receive_json(peers, 0)
    assert values is not None and len(values) == peers.size
    for rank in range(1, peers.size):
        send_json(peers, values[rank], rank)
    return values[0]


def send_json(peers: Peers, value: Any, to: int) -> None:
    """Send a JSON-able ``value`` to rank ``to``, which takes it with :func:`receive_json`."""
    payload = _encode(value)
    length = torch.frombuffer(bytearray(struct.pack("=q", payload.numel())), dtype=torch.uint8)  # int64, as received
    peers.send(length, to)
    peers.send(payload, to)


def receive_json(peers: Peers, sender: int) -> Any:
    """The value rank ``sender`` sends with :func:`send_json`."""
    length = int(peers.receive(8, sender).view(torch.int64).item())
    return _decode(peers.receive(length, sender))


_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""One all-gather into one tensor (``all_gather_into_tensor`` before torch named it ``all_gather_single``)."""


def all_gather_json(value: Any, group: Any) -> list[Any]:
    """Every rank's JSON-able ``value``, in rank order (no pickling)."""
    payload = _encode(value)
    size = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([payload.numel()], dtype=torch.int64), group=group)
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    return [_decode(g[: int(n.item())]) for g, n in zip(gathered, lengths)]


def _encode(value: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def _decode(payload: torch.Tensor) -> Any:
    return json.loads(bytes(payload.numpy()))
