"""An in-process world of N ranks for the message logic of checkfreq.ranks: each rank runs on a
thread of its own, and its :class:`FakePeers` talk to the others through one FIFO queue per
(sender, receiver), as gloo keeps the order of one pair's messages. Not a test of gloo: the real
transport is tests/distributed's."""

from __future__ import annotations

import json
import queue
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

WAIT_S = 60.0
"""How long a receive waits for its message before the test fails (generous: the machine may be busy)."""


class Wire:
    """The queues between ``size`` ranks, and how many messages each rank sent and received."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.queues = {(a, b): queue.Queue[tuple[str, Any]]() for a in range(size) for b in range(size) if a != b}
        self.sent: Counter[int] = Counter()
        self.received: Counter[int] = Counter()
        self._lock = threading.Lock()

    def put(self, sender: int, to: int, kind: str, item: Any) -> None:
        with self._lock:
            self.sent[sender] += 1
        self.queues[(sender, to)].put((kind, item))

    def take(self, receiver: int, sender: int, kind: str) -> Any:
        got, item = self.queues[(sender, receiver)].get(timeout=WAIT_S)
        assert got == kind, f"rank {receiver} expected a {kind} message from rank {sender}, got a {got} one"
        with self._lock:
            self.received[receiver] += 1
        return item


class FakePeers:
    """One rank's view of a :class:`Wire` (the ``Peers`` protocol of checkfreq.ranks.collectives)."""

    def __init__(self, wire: Wire, rank: int) -> None:
        self.wire, self.rank, self.size = wire, rank, wire.size

    def all_gather(self, value: Any) -> list[Any]:
        for other in range(self.size):
            if other != self.rank:
                self.wire.put(self.rank, other, "json", json.dumps(value))
        return [
            json.loads(json.dumps(value)) if r == self.rank else json.loads(self.wire.take(self.rank, r, "json"))
            for r in range(self.size)
        ]

    def gather(self, value: Any) -> list[Any] | None:
        if self.rank != 0:
            self.wire.put(self.rank, 0, "json", json.dumps(value))
            return None
        return [json.loads(json.dumps(value))] + [json.loads(self.wire.take(0, r, "json")) for r in range(1, self.size)]

    def broadcast(self, value: Any) -> Any:
        if self.rank != 0:
            return json.loads(self.wire.take(self.rank, 0, "json"))
        for other in range(1, self.size):
            self.wire.put(0, other, "json", json.dumps(value))
        return json.loads(json.dumps(value))

    def all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.tensor(r, dtype=torch.uint8) for r in self.all_gather(row.tolist())])

    def send(self, payload: torch.Tensor, to: int) -> None:
        assert payload.dtype == torch.uint8 and payload.dim() == 1
        self.wire.put(self.rank, to, "bytes", bytes(payload.numpy()))

    def receive(self, size: int, sender: int) -> torch.Tensor:
        data = self.wire.take(self.rank, sender, "bytes")
        assert len(data) == size, f"rank {self.rank} expected {size} bytes from rank {sender}, got {len(data)}"
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def run_ranks(size: int, fn: Callable[[FakePeers], Any]) -> tuple[list[Any], Wire]:
    """``fn(peers)`` on every rank of a fresh world of ``size``, each on a thread; their results in rank
    order (an exception on any rank is raised here), and the wire."""
    wire = Wire(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(FakePeers(wire, rank))
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(rank,), daemon=True) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S * 2)
    assert not any(thread.is_alive() for thread in threads), "a rank is still waiting for a message"
    if errors:
        raise errors[0]
    assert all(q.empty() for q in wire.queues.values()), "a message was sent that no rank received"
    return results, wire
