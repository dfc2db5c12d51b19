"""Small JSON messages between ranks (and, at restore, whole files sent from one rank to another
and the replicated tensors all-gathered in rows of one tensor), and the same calls for a world of one.

The commit, upload and restore protocols are written once against :class:`Peers`: under
``torch.distributed`` a :class:`GroupPeers` carries the messages over a dedicated gloo group; a
single process is a :class:`Solo` world, where every collective returns at once. Messages are
JSON, never pickles.

Every message is a typed value (:class:`Message`: it encodes itself with ``to_wire`` and decodes
with its class's ``from_wire``); protocols exchange them with the typed helpers
(:func:`gather_messages`, :func:`broadcast_message`, :func:`all_gather_messages`,
:func:`send_message`, :func:`receive_message`, :func:`scatter_messages`), never raw JSON.
"""

from __future__ import annotations

import contextlib
import json
import queue
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from checkfreq.errors import PeerLostError

if TYPE_CHECKING:
    from typing_extensions import Self

    from checkfreq.ranks.liveness import Liveness

JSON = Any
"""A JSON value as :func:`json.dumps` writes it and :func:`json.loads` reads it back (dicts with string
keys, lists, strings, numbers, booleans, None): what a message is on the wire."""


class Message(Protocol):
    """A message between ranks: a typed value with its own encoder and decoder.

    ``type(m).from_wire(json.loads(json.dumps(m.to_wire()))) == m`` for every message ``m``.
    """

    def to_wire(self) -> JSON:
        """The message as sent: plain JSON."""
        ...

    @classmethod
    def from_wire(cls, wire: JSON) -> Self:
        """The message a rank sent, from what :meth:`to_wire` made of it."""
        ...


M = TypeVar("M")
Decoder = Callable[[JSON], M]
"""What reads a message back from the wire: a message class's ``from_wire`` (or, where one of several
kinds may come, a function that tells them apart)."""


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
    """The ranks of a gloo process group (the group's rank 0 is the sender of broadcasts).

    With a :class:`~checkfreq.ranks.liveness.Liveness`, every call is bounded by the failure timeout:
    the messages move on a thread of the group's own while the calling thread watches the ranks it
    waits for, and raises :class:`~checkfreq.errors.PeerLostError` (naming the rank, and
    :attr:`activity`) when one is lost or closed its connection; the group is then broken, and every
    later call raises the same error at once. Without one, calls run on the calling thread and
    wait as long as gloo's timeout.
    """

    def __init__(
        self, group: Any, liveness: Liveness | None = None, activity: str = "an exchange between the ranks"
    ) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.activity = activity
        """What the ranks are doing on this group, as errors name it (see :func:`during`)."""
        self._liveness = liveness
        self._failure: PeerLostError | None = None
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] | None = None
        if liveness is not None:
            self._calls = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._calls,), name="checkfreq-messages", daemon=True).start()

    @property
    def liveness(self) -> Liveness | None:
        """The heartbeats that bound its waits (None: gloo's timeout alone)."""
        return self._liveness

    def all_gather(self, value: Any) -> list[Any]:
        return self._call(lambda: all_gather_json(value, self.group), None)

    def gather(self, value: Any) -> list[Any] | None:
        return self._call(lambda: gather_json(value, self.group), None if self.rank == 0 else [0])

    def broadcast(self, value: Any) -> Any:
        return self._call(lambda: broadcast_json(value, self.group), None if self.rank == 0 else [0])

    def all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        def gather_rows() -> torch.Tensor:
            rows = torch.empty(self.size, row.numel(), dtype=torch.uint8)
            _all_gather_single(rows.view(-1), row, group=self.group)
            return rows

        return self._call(gather_rows, None)

    def send(self, payload: torch.Tensor, to: int) -> None:
        if payload.numel():
            self._call(lambda: dist.send(payload, group=self.group, group_dst=to), [to])

    def receive(self, size: int, sender: int) -> torch.Tensor:
        buffer = torch.empty(size, dtype=torch.uint8)
        if size:
            self._call(lambda: dist.recv(buffer, group=self.group, group_src=sender), [sender])
        return buffer

    def close(self) -> None:
        """Stop the group's message thread (the group is about to be destroyed)."""
        if self._calls is not None:
            self._calls.put(None)

    def _call(self, exchange: Callable[[], Any], awaited: list[int] | None) -> Any:
        """``exchange()``'s result, waiting for ``awaited`` (None: every other rank) under the liveness's watch."""
        liveness = self._liveness
        if liveness is None or self._calls is None:
            return exchange()
        failure = self._failure or liveness.failure
        if failure is not None:  # the job failed: no exchange can succeed
            raise failure
        ranks = [r for r in range(self.size) if r != self.rank] if awaited is None else awaited
        answer: Future[Any] = Future()
        self._calls.put((exchange, answer))
        while True:
            try:
                return answer.result(timeout=POLL_S)
            except FutureTimeout:
                try:
                    liveness.check(ranks, self.activity)
                except PeerLostError as e:
                    self._failure = e
                    raise
            except RuntimeError as e:  # gloo's: a closed connection, a timeout
                rank = e.rank if isinstance(e, PeerFailure) else (ranks[0] if len(ranks) == 1 else None)
                self._failure = liveness.closed(rank, self.activity, e)
                raise self._failure from e


POLL_S = 0.1
"""How often a thread waiting on other ranks looks at their liveness (it reads their heartbeats less often)."""


def _serve(calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None]) -> None:
    """A group's message thread: runs each exchange handed to it, in order."""
    while (call := calls.get()) is not None:
        exchange, answer = call
        try:
            answer.set_result(exchange())
        except BaseException as e:  # noqa: BLE001 - raised on the calling thread
            answer.set_exception(e)


@contextlib.contextmanager
def during(peers: Peers, activity: str) -> Iterator[None]:
    """Name what the ranks do on ``peers`` while in the block (errors say it), where ``peers`` names its activity."""
    if not isinstance(peers, GroupPeers):
        yield
        return
    before = peers.activity
    peers.activity = activity
    try:
        yield
    finally:
        peers.activity = before


class PeerFailure(RuntimeError):
    """A message to or from one rank failed, as it was posted or awaited (gloo's error is the cause);
    ``rank`` names it."""

    def __init__(self, rank: int, error: BaseException) -> None:
        super().__init__(f"rank {rank}: {error}")
        self.rank = rank


def broadcast_json(value: Any, group: Any) -> Any:
    """Rank 0's JSON-able ``value`` on every rank of ``group`` (no pickling).

    Point to point: rank 0 sends its length and its message to each other rank, all at once, so
    that a failed send names its rank; another rank receives two messages whatever the number of ranks.
    """
    size = dist.get_world_size(group)
    if dist.get_rank(group) != 0:
        length = torch.zeros(1, dtype=torch.int64)
        _post_and_wait([(0, partial(dist.irecv, length, group=group, group_src=0))])
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        _post_and_wait([(0, partial(dist.irecv, payload, group=group, group_src=0))])
        return _decode(payload)
    payload = _encode(value)
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    _post_and_wait([(r, partial(dist.isend, length, group=group, group_dst=r)) for r in range(1, size)])
    _post_and_wait([(r, partial(dist.isend, payload, group=group, group_dst=r)) for r in range(1, size)])
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
        _post_and_wait([(0, partial(dist.isend, length, group=group, group_dst=0))])
        _post_and_wait([(0, partial(dist.isend, payload, group=group, group_dst=0))])
        return None
    lengths = [length] + [torch.zeros(1, dtype=torch.int64) for _ in range(1, size)]
    _post_and_wait([(r, partial(dist.irecv, lengths[r], group=group, group_src=r)) for r in range(1, size)])
    payloads = [payload] + [torch.empty(int(lengths[r].item()), dtype=torch.uint8) for r in range(1, size)]
    _post_and_wait([(r, partial(dist.irecv, payloads[r], group=group, group_src=r)) for r in range(1, size)])
    return [_decode(p) for p in payloads]


def _post_and_wait(posts: list[tuple[int, Callable[[], Any]]]) -> None:
    """Post point-to-point messages together (each ``(rank, post)``: ``post()`` sends to or receives
    from ``rank`` and returns its Work), then wait for each; a failure names its rank
    (:class:`PeerFailure`), in the post as in the wait: gloo refuses a message at once, when it is
    posted, to or from a rank whose connection had already closed."""
    works = []
    for rank, post in posts:
        try:
            works.append((rank, post()))
        except RuntimeError as e:
            raise PeerFailure(rank, e) from e
    for rank, work in works:
        try:
            work.wait()
        except RuntimeError as e:
            raise PeerFailure(rank, e) from e


def collect_errors(peers: Peers, error: str | None) -> list[str]:
    """Every rank's error (None: it has none), the same list on every rank.

    Gathered on rank 0 and broadcast back: a rank other than 0 sends and receives a few bytes when
    no rank failed, whatever the number of ranks.
    """
    gathered = gather_messages(peers, RankError(error), RankError.from_wire)
    answer = None if gathered is None else RankErrors([g.error for g in gathered if g.error])
    return broadcast_message(peers, answer, RankErrors.from_wire).errors


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


def gather_messages(peers: Peers, message: Message, decode: Decoder[M]) -> list[M] | None:
    """On rank 0, every rank's ``message`` in rank order; None on the other ranks."""
    gathered = peers.gather(message.to_wire())
    return None if gathered is None else [decode(wire) for wire in gathered]


def broadcast_message(peers: Peers, message: Message | None, decode: Decoder[M]) -> M:
    """Rank 0's ``message`` on every rank (the other ranks pass None)."""
    return decode(peers.broadcast(None if message is None else message.to_wire()))


def all_gather_messages(peers: Peers, message: Message, decode: Decoder[M]) -> list[M]:
    """Every rank's ``message``, in rank order, on every rank."""
    return [decode(wire) for wire in peers.all_gather(message.to_wire())]


def send_message(peers: Peers, message: Message, to: int) -> None:
    """Send ``message`` to rank ``to``, which takes it with :func:`receive_message`."""
    send_json(peers, message.to_wire(), to)


def receive_message(peers: Peers, sender: int, decode: Decoder[M]) -> M:
    """The message rank ``sender`` sends with :func:`send_message`."""
    return decode(receive_json(peers, sender))


def scatter_messages(peers: Peers, messages: Sequence[Message] | None, decode: Decoder[M]) -> M:
    """Rank 0's ``messages[r]`` on each rank ``r`` (other ranks pass None), as :func:`scatter_json` sends them."""
    return decode(scatter_json(peers, None if messages is None else [m.to_wire() for m in messages]))


@dataclass(frozen=True)
class RankError:
    """Rank → 0: this rank's error, or None: it has none. On the wire: the text, or null."""

    error: str | None

    def to_wire(self) -> JSON:
        return self.error

    @classmethod
    def from_wire(cls, wire: JSON) -> RankError:
        return cls(None if wire is None else str(wire))


@dataclass(frozen=True)
class RankErrors:
    """0 → every rank: every rank's error, in rank order (none: no rank failed). On the wire: a list."""

    errors: list[str]

    def to_wire(self) -> JSON:
        return self.errors

    @classmethod
    def from_wire(cls, wire: JSON) -> RankErrors:
        return cls([str(e) for e in wire])


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
    return [_decode(g[: int(n.item())]) for g, n in zip(gathered, lengths, strict=True)]


def _encode(value: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def _decode(payload: torch.Tensor) -> Any:
    return json.loads(bytes(payload.numpy()))
