"""What each simulated rank of ``benchmarks/protocol_sim.py`` sends, receives, computes and reads,
phase by phase: :class:`Counts`, a rank's :class:`Ledger`, :class:`CountingPeers`, which counts a
rank's messages on any :class:`~checkfreq.ranks.collectives.Peers` (``tests/distributed/test_scale.py``
counts real gloo groups with it), :class:`CountingStore`, which counts its operations on the key-value
store, and :class:`CountedLocalStore`, which notes the data files it reads. A message counts its JSON
and an 8-byte length: a gather is each rank's message to rank 0, a broadcast rank 0's message to each
rank, an all-gather each rank's message to every other rank."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from benchmarks.sim_transport import Baton, Gathered, MemoryStore
from checkfreq.ranks.collectives import Peers
from checkfreq.storage.local import LocalStore


def message_bytes(value: Any) -> int:
    """A JSON message's bytes on the wire: its length (8 bytes), then its JSON."""
    return 8 + len(json.dumps(value))


@dataclass
class Counts:
    """What one rank did in one phase."""

    messages_out: int = 0
    messages_in: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    all_gathers: int = 0
    store_ops: int = 0
    store_polls: int = 0
    """Of ``store_ops``, those that only look (an ``add`` of 0), repeated while waiting."""
    cpu_s: float = 0.0
    wall_s: float = 0.0
    files_read: list[str] = field(default_factory=list)
    lookups: int = 0
    """Data files whose size it asked its store for (a ``stat`` in a directory)."""
    peers: set[int] = field(default_factory=set)
    everyone: bool = False
    """It exchanged messages with every other rank (an all-gather)."""

    def connections(self, rank: int, size: int) -> int:
        return size - 1 if self.everyone else len(self.peers - {rank})

    def to_all(self, nbytes: int, size: int) -> None:
        self.messages_out += size - 1
        self.bytes_out += nbytes * (size - 1)
        self.everyone = self.everyone or size > 1

    def from_all(self, nbytes: int, size: int) -> None:
        self.messages_in += size - 1
        self.bytes_in += nbytes
        self.everyone = self.everyone or size > 1


class Ledger:
    """One rank's counts, phase by phase; the phase now running takes what its calls cost.

    ``baton``: the simulation's, whose uncounted CPU is left out of the rank's CPU time."""

    def __init__(self, baton: Baton | None = None) -> None:
        self.phases: dict[str, Counts] = {}
        self.now = Counts()
        self._baton = baton

    def _cpu(self) -> float:
        return time.thread_time() - (self._baton.uncounted() if self._baton is not None else 0.0)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[Counts]:
        self.now = self.phases[name] = Counts()
        started, began = self._cpu(), time.perf_counter()
        try:
            yield self.now
        finally:
            self.now.cpu_s, self.now.wall_s = self._cpu() - started, time.perf_counter() - began


class CountingPeers:
    """Any :class:`~checkfreq.ranks.collectives.Peers`, counting the messages this rank sends and receives
    through it into ``ledger`` (see the module docstring); the messages still go through ``inner``."""

    def __init__(self, inner: Peers, ledger: Ledger | None = None) -> None:
        self.inner, self.ledger = inner, ledger if ledger is not None else Ledger()
        self.rank, self.size = inner.rank, inner.size

    def __getattr__(self, name: str) -> Any:  # what else ``inner`` has (a gloo group's ``group``)
        return getattr(self.inner, name)

    def all_gather(self, value: Any) -> list[Any]:
        values = self.inner.all_gather(value)
        counts, own = self.ledger.now, message_bytes(value)
        total = values.nbytes if isinstance(values, Gathered) else sum(message_bytes(v) for v in values)
        counts.all_gathers += 1
        counts.to_all(own, self.size)
        counts.from_all(total - own, self.size)
        return values

    def gather(self, value: Any) -> list[Any] | None:
        values = self.inner.gather(value)
        counts = self.ledger.now
        if values is None:
            counts.messages_out += 1
            counts.bytes_out += message_bytes(value)
            counts.peers.add(0)
        else:
            total = values.nbytes if isinstance(values, Gathered) else sum(message_bytes(v) for v in values)
            counts.from_all(total - message_bytes(value), self.size)
        return values

    def broadcast(self, value: Any) -> Any:
        value = self.inner.broadcast(value)
        counts = self.ledger.now
        if self.rank == 0:
            counts.to_all(message_bytes(value), self.size)
        else:
            counts.messages_in += 1
            counts.bytes_in += message_bytes(value)
            counts.peers.add(0)
        return value

    def all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        rows = self.inner.all_gather_rows(row)
        counts = self.ledger.now
        counts.all_gathers += 1
        counts.to_all(row.numel(), self.size)
        counts.from_all(row.numel() * (self.size - 1), self.size)
        return rows

    def send(self, payload: torch.Tensor, to: int) -> None:
        self.inner.send(payload, to)
        counts = self.ledger.now
        counts.messages_out += 1
        counts.bytes_out += payload.numel()
        counts.peers.add(to)

    def receive(self, size: int, sender: int) -> torch.Tensor:
        payload = self.inner.receive(size, sender)
        counts = self.ledger.now
        counts.messages_in += 1
        counts.bytes_in += size
        counts.peers.add(sender)
        return payload


class CountingStore:
    """The operations of ``torch.distributed.Store`` that start-up uses, on ``inner``, each call
    counted in ``ledger`` as one operation (a round trip); an ``add`` of 0 is also a poll."""

    def __init__(self, inner: MemoryStore, ledger: Ledger) -> None:
        self.inner, self.ledger = inner, ledger

    def _op(self) -> MemoryStore:
        self.ledger.now.store_ops += 1
        return self.inner

    def set(self, key: str, value: str | bytes) -> None:
        self._op().set(key, value)

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self._op().multi_set(keys, values)

    def get(self, key: str) -> bytes:
        return self._op().get(key)

    def add(self, key: str, amount: int) -> int:
        store = self._op()
        if amount == 0:
            self.ledger.now.store_polls += 1
        return store.add(key, amount)

    def append(self, key: str, value: str | bytes) -> None:
        self._op().append(key, value)

    def check(self, keys: Sequence[str]) -> bool:
        return self._op().check(keys)

    def wait(self, keys: Sequence[str], timeout: timedelta) -> None:
        self._op().wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self._op().delete_key(key)


class CountedLocalStore(LocalStore):
    """A local directory that notes, in its rank's ledger, each data file it reads and each it looks up."""

    def __init__(self, root: Path, ledger: Ledger) -> None:
        super().__init__(root)
        self._ledger = ledger

    def read_data(self, location: Path, name: str, size: int, checksum: str) -> tuple[torch.Tensor, dict[str, Any]]:
        self._ledger.now.files_read.append(name)
        return super().read_data(location, name, size, checksum)

    def file_size(self, location: Path, name: str) -> int | None:
        self._ledger.now.lookups += 1
        return super().file_size(location, name)
