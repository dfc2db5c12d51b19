"""checkfreq's distributed protocol at N ranks, each rank's real code on a thread of its own.

Usage: ``python benchmarks/protocol_sim.py [--worlds 64,1024,4096,16384] [--restore-up-to 64] [--state fsdp2]``

Every rank runs checkfreq's own code: start-up (``wait_for_every_rank`` and ``agree_on_token`` over a
key-value store, then ``ranks.group_cluster.meet``: the job's token, who shares a directory, each directory
opened), a memory tier's start-up (``ranks.sharing.memory_group``: which ranks share a machine, 8 to a
machine), one commit (``pipeline.commit.Committer.run``, which writes a real data file per rank and rank 0's
``manifest.json`` into one shared directory), three exchanges of the vote on when to checkpoint
(``ranks.collectives.tree_max``, what ``ranks.agreement.AgreedPolicy``'s vote thread runs), and the restore
(``pipeline.restore.Restorer.find``: the choice of step, rank 0's plan, each file read and verified by one
rank, and the replicated tensors all-gathered; the directory is taken for one on a network file
system, where no two ranks share a page cache, as in a job of many nodes).
What stands in for the real thing:

* the transport: :class:`MemoryPeers` implements :class:`checkfreq.ranks.collectives.Peers` in memory.
  Collectives are matched by their order, point-to-point messages by (sender, receiver). A message
  counts as ``tests/distributed/test_scale.py`` counts it on real gloo groups (:class:`CountingPeers`, shared
  with that test): its JSON and an 8-byte length; a gather is each rank's message to rank 0, a
  broadcast rank 0's message to each rank, an all-gather each rank's message to every other rank.
  A rank's *connections* are the distinct ranks it exchanged messages with (gloo pairs connected
  on first use);
* the key-value store: :class:`MemoryStore`, the operations of ``torch.distributed.Store`` that
  start-up uses, each call counted as one operation (a round trip); an ``add`` of 0 is a poll;
* the training: each rank's snapshot is the state of a DDP job (``--layers`` linear layers and
  AdamW, 8 replicated tensors a layer, split over the ranks by checkfreq's plan, and each rank's
  random-generator tensors), zeros, built with ``benchmarks/scale_costs.py``'s helpers; with
  ``--state fsdp2``, the same tensors under FSDP2: each rank holds block ``rank`` of every
  parameter's and optimizer state's rows (``Shard(0)``), as ``GroupCluster.select`` records it,
  and restores the same blocks (AdamW's step counts stay replicated).

All-gathered lists are decoded once and shared by the ranks that receive them (the protocol code
only reads them), so the JSON parse of an all-gather is in no rank's CPU time; a gather's and a
broadcast's are in the receiver's. A rank's CPU time is ``time.thread_time()`` of its thread
but for what the thread spends blocked in the transport or the store, waking the ranks its
messages and store writes reach, and carrying point-to-point messages (the transport's own work);
one rank computes at a time and wakes the others only when it waits (:class:`Baton`), and the
cyclic garbage collector is off while the ranks run, so that neither thousands of threads
contending for the interpreter nor a collection of every rank's objects is counted as some rank's
work.

The restore runs on every rank up to ``--restore-up-to`` ranks (each rank receives a row from every rank,
so the simulator's restore moves O(N²) bytes in all); above, what it would cost is
measured alone: rank 0's plan (``restore.plan.ReadPlan``) over N views (on one shared directory, every
rank's view is rank 0's, built by the restorer's own code), and what every rank computes of the
stream (``restore.stream.ReplicatedStream``: its layout, and the replicated tensors taken out of the N rows).

Prints, per N and phase, each count for rank 0 and the median and maximum over the other ranks,
and a verdict per acceptance criterion.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.replica_sim import (  # noqa: E402
    DISK_STEP,
    OWN_BYTES,
    STRIDE,
    KeptCopies,
    Loss,
    copy_counts,
    measured_senders,
    per_snapshot,
    plan_seconds,
)
from benchmarks.scale_costs import PRIVATE_TENSORS, costs, replicated_state, skeleton  # noqa: E402
from checkfreq.pipeline.commit import CommitJob, CommitResult, Committer  # noqa: E402
from checkfreq.pipeline.restore import Found, Restorer  # noqa: E402
from checkfreq.pipeline.restore.copies import fetch_copies  # noqa: E402
from checkfreq.pipeline.restore.plan import ReadPlan, fetch_plan  # noqa: E402
from checkfreq.pipeline.restore.protocol import Readable  # noqa: E402
from checkfreq.pipeline.restore.stream import ReplicatedStream  # noqa: E402
from checkfreq.pipeline.retainer import Retainer  # noqa: E402
from checkfreq.pipeline.snapshot import PendingSnapshot, aligned_empty  # noqa: E402
from checkfreq.pipeline.tier import TierName  # noqa: E402
from checkfreq.pipeline.tiers import LocalTier, Tiers  # noqa: E402
from checkfreq.policies.retention import Retention  # noqa: E402
from checkfreq.ranks import replicas  # noqa: E402
from checkfreq.ranks.collectives import Peers, Solo, tree_max  # noqa: E402
from checkfreq.ranks.group_cluster import SharePlan, meet, wait_for_every_rank  # noqa: E402
from checkfreq.ranks.groups import agree_on_token  # noqa: E402
from checkfreq.ranks.rebuild import Box  # noqa: E402
from checkfreq.ranks.shares import PRIVATE, SHARDED, partition, private_name  # noqa: E402
from checkfreq.ranks.sharing import memory_group  # noqa: E402
from checkfreq.storage.format import DTYPE_CODES, plan_layout  # noqa: E402
from checkfreq.storage.local import LocalStore  # noqa: E402

WORLDS = "64,1024,4096,16384"
LAYERS = 50
RANKS_PER_MACHINE = 8
"""50 linear layers and AdamW: 400 replicated tensors."""
STEP = 100
TIMEOUT_S = 1800.0
STACK_BYTES = 256 << 10
"""Each rank thread's stack: 16,384 threads reserve 4 GiB of address space, of which they touch little."""
PHASES = ("startup", "memory group", "commit", "snapshot copy", "vote", "fetch round", "restore")
COPY_PHASE = "snapshot copy"
"""Counted from real copies (``benchmarks/replica_sim.py``), not run on the ranks' threads: no CPU or file counts."""


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


class Gathered(list):
    """A gathered or all-gathered list that knows its bytes on the wire (summed by the transport
    as it carries them, so that counting costs no rank a second encoding of every message)."""

    nbytes: int


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


# ---------------------------------------------------------------------------------- the transport


_SLEEP = time.sleep


class Baton:
    """One simulated rank computes at a time: a rank holds the baton while it runs and passes it on
    whenever it waits (for a message, a store key, or in ``time.sleep``), so that its CPU time is its
    own work, not thousands of threads contending for the interpreter. What the holder's messages and
    store writes wake (:meth:`wake`) is woken only when it passes the baton on, so that no other rank
    thread becomes runnable while it computes.

    The CPU a thread spends waiting, waking the ranks it delivered to (a broadcast to thousands of
    threads wakes every one) and in the simulated transport's bookkeeping (:meth:`aside`) is kept
    apart (:meth:`uncounted`): a process blocked on a socket spends none, and the rest is the
    stand-in's work, not the protocol's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mine = threading.local()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self._lock.acquire()
        self._mine.held, self._mine.wakes = True, []
        try:
            yield
        finally:
            self._wake_all()
            self._mine.held = False
            self._lock.release()

    @contextlib.contextmanager
    def passed(self) -> Iterator[None]:
        """Wake the ranks this thread delivered to, and let the other ranks run meanwhile (if this
        thread holds the baton); uncounted."""
        held = getattr(self._mine, "held", False)
        with self.aside():
            if held:
                self._wake_all()
                self._mine.held = False
                self._lock.release()
            try:
                yield
            finally:
                if held:
                    self._lock.acquire()
                    self._mine.held = True

    def aside(self) -> _Aside:
        """Keep this thread's CPU in the block out of its rank's (nested blocks count once)."""
        return _Aside(self._mine)

    def uncounted(self) -> float:
        """CPU seconds this thread has spent so far outside its rank's own work (see the class)."""
        return getattr(self._mine, "uncounted", 0.0)

    def wake(self, action: Callable[[], None]) -> None:
        """Run ``action``, which wakes the ranks waiting for what this thread delivered: when this
        thread next passes the baton on if it holds it, else now."""
        if getattr(self._mine, "held", False):
            self._mine.wakes.append(action)
        else:
            action()

    def _wake_all(self) -> None:
        wakes, self._mine.wakes = self._mine.wakes, []
        for action in wakes:
            action()

    def sleep(self, seconds: float) -> None:
        """``time.sleep`` while the simulation runs: polling ranks pass the baton."""
        with self.passed():
            _SLEEP(seconds)


class _Aside:
    """:meth:`Baton.aside`'s block: a class, not a generator, so that little of its own cost is counted."""

    __slots__ = ("_mine", "_began")

    def __init__(self, mine: threading.local) -> None:
        self._mine = mine

    def __enter__(self) -> None:
        self._mine.depth = getattr(self._mine, "depth", 0) + 1
        self._began = time.thread_time()

    def __exit__(self, *_: object) -> None:
        ended = time.thread_time()
        self._mine.depth -= 1
        if self._mine.depth == 0:
            self._mine.uncounted = getattr(self._mine, "uncounted", 0.0) + ended - self._began


class _Round:
    """One collective call, as every rank makes it: each rank's encoded message, in rank order."""

    def __init__(self, size: int, baton: Baton) -> None:
        self.baton = baton
        self.payloads: list[bytes | None] = [None] * size
        self.missing = self.left = size
        self.lock = threading.Lock()
        self.full = threading.Event()
        self.root = threading.Event()
        self.shared: Gathered | None = None

    def put(self, rank: int, payload: bytes | None) -> None:
        self.payloads[rank] = payload
        with self.lock:
            self.missing -= 1
            if self.missing == 0:
                self.baton.wake(self.full.set)
        if rank == 0:
            self.baton.wake(self.root.set)


class Fabric:
    """The in-memory network of a simulated world."""

    def __init__(self, size: int, baton: Baton, timeout: float = TIMEOUT_S) -> None:
        self.size, self.baton, self.timeout = size, baton, timeout
        self._lock = threading.Lock()
        self._rounds: dict[int, _Round] = {}
        self._channels: dict[tuple[int, int], tuple[threading.Condition, deque[bytes]]] = {}

    def round(self, index: int) -> _Round:
        with self._lock:
            found = self._rounds.get(index)
            if found is None:
                found = self._rounds[index] = _Round(self.size, self.baton)
            return found

    def leave(self, index: int, done: _Round) -> None:
        """This rank is done with round ``index``: the last to leave frees it."""
        with done.lock:
            done.left -= 1
            last = done.left == 0
        if last:
            with self._lock:
                del self._rounds[index]

    def channel(self, sender: int, receiver: int) -> tuple[threading.Condition, deque[bytes]]:
        with self._lock:
            found = self._channels.get((sender, receiver))
            if found is None:
                found = self._channels[(sender, receiver)] = (threading.Condition(), deque())
            return found

    def wait(self, event: threading.Event, rank: int, what: str) -> None:
        with self.baton.passed():
            arrived = event.wait(self.timeout)
        if not arrived:
            raise RuntimeError(f"simulated rank {rank} waited more than {self.timeout:.0f} s for {what}")


def _notify(condition: threading.Condition, every: bool = False) -> None:
    """Wake one thread waiting on ``condition`` (every one with ``every``)."""
    with condition:
        if every:
            condition.notify_all()
        else:
            condition.notify()


class MemoryPeers:
    """:class:`~checkfreq.ranks.collectives.Peers` over a :class:`Fabric`: JSON messages, never pickles."""

    def __init__(self, fabric: Fabric, rank: int) -> None:
        self.fabric, self.rank, self.size = fabric, rank, fabric.size
        self._calls = 0

    def _next(self) -> tuple[int, _Round]:
        index, self._calls = self._calls, self._calls + 1
        return index, self.fabric.round(index)

    def all_gather(self, value: Any) -> list[Any]:
        index, now = self._next()
        now.put(self.rank, json.dumps(value).encode())
        self.fabric.wait(now.full, self.rank, f"an all-gather (call {index})")
        with now.lock:
            if now.shared is None:
                now.shared = Gathered(json.loads(p) for p in now.payloads)  # type: ignore[arg-type]
                now.shared.nbytes = sum(8 + len(p) for p in now.payloads)  # type: ignore[arg-type]
            shared = now.shared
        self.fabric.leave(index, now)
        return shared

    def gather(self, value: Any) -> list[Any] | None:
        index, now = self._next()
        now.put(self.rank, json.dumps(value).encode())
        if self.rank != 0:
            self.fabric.leave(index, now)
            return None
        self.fabric.wait(now.full, self.rank, f"a gather (call {index})")
        values = Gathered(json.loads(p) for p in now.payloads)  # type: ignore[arg-type]
        values.nbytes = sum(8 + len(p) for p in now.payloads)  # type: ignore[arg-type]
        self.fabric.leave(index, now)
        return values

    def broadcast(self, value: Any) -> Any:
        index, now = self._next()
        now.put(self.rank, json.dumps(value).encode() if self.rank == 0 else None)
        self.fabric.wait(now.root, self.rank, f"a broadcast (call {index})")
        value = json.loads(now.payloads[0])  # type: ignore[arg-type]
        self.fabric.leave(index, now)
        return value

    def all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        index, now = self._next()
        now.put(self.rank, row.numpy().tobytes())
        self.fabric.wait(now.full, self.rank, f"an all-gather of rows (call {index})")
        with now.lock:
            if now.shared is None:
                now.shared = torch.frombuffer(bytearray(b"".join(now.payloads)), dtype=torch.uint8).view(self.size, -1)  # type: ignore[arg-type]
            shared = now.shared
        self.fabric.leave(index, now)
        return shared

    def send(self, payload: torch.Tensor, to: int) -> None:
        with self.fabric.baton.aside():  # the transport's work
            condition, queue = self.fabric.channel(self.rank, to)
            with condition:
                queue.append(payload.numpy().tobytes())
            self.fabric.baton.wake(lambda: _notify(condition))

    def receive(self, size: int, sender: int) -> torch.Tensor:
        with self.fabric.baton.aside():  # the transport's work, and the wait
            condition, queue = self.fabric.channel(sender, self.rank)
            with self.fabric.baton.passed(), condition:
                if not condition.wait_for(lambda: queue, self.fabric.timeout):
                    raise RuntimeError(f"simulated rank {self.rank} waited more than {self.fabric.timeout:.0f} s "
                                       f"for rank {sender}")
                data = queue.popleft()
            if len(data) != size:
                raise RuntimeError(f"rank {self.rank} expected {size} bytes from rank {sender}, got {len(data)}")
            return torch.frombuffer(bytearray(data), dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)


# --------------------------------------------------------------------------------- the key-value store


class MemoryStore:
    """The job's key-value store, in memory, shared by the simulated ranks. A write wakes only the
    ranks waiting for its key (thousands of ranks wait at once at start-up)."""

    def __init__(self, baton: Baton) -> None:
        self.baton = baton
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self._waiting: dict[str, threading.Condition] = {}

    def written(self, key: str) -> None:
        """Wake the ranks waiting for ``key`` (with :attr:`lock` held)."""
        condition = self._waiting.pop(key, None)
        if condition is not None:
            self.baton.wake(lambda: _notify(condition, every=True))

    def wait_for(self, keys: Sequence[str], timeout: float) -> None:
        """Block until every key in ``keys`` is set (with :attr:`lock` held)."""
        deadline = time.monotonic() + timeout
        for key in keys:
            while key not in self.data:
                left = deadline - time.monotonic()
                condition = self._waiting.setdefault(key, threading.Condition(self.lock))
                if left <= 0 or not condition.wait(left) and key not in self.data:
                    raise RuntimeError(f"key {key} not set within {timeout:.0f} s")


class StoreView:
    """The operations of ``torch.distributed.Store`` that start-up uses, on a :class:`MemoryStore`,
    each counted in this rank's ledger as one operation."""

    def __init__(self, store: MemoryStore, ledger: Ledger) -> None:
        self._store, self._ledger = store, ledger

    def _op(self) -> MemoryStore:
        self._ledger.now.store_ops += 1
        return self._store

    def set(self, key: str, value: str | bytes) -> None:
        self.multi_set([key], [value])

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        store = self._op()
        with store.lock:
            for key, value in zip(keys, values, strict=True):
                store.data[key] = value.encode() if isinstance(value, str) else value
                store.written(key)

    def get(self, key: str) -> bytes:
        store = self._op()
        with store.baton.passed(), store.lock:
            store.wait_for([key], TIMEOUT_S)
            return store.data[key]

    def add(self, key: str, amount: int) -> int:
        store = self._op()
        if amount == 0:
            self._ledger.now.store_polls += 1
        with store.lock:
            value = int(store.data.get(key, b"0")) + amount
            store.data[key] = str(value).encode()
            store.written(key)
            return value

    def append(self, key: str, value: str | bytes) -> None:
        store = self._op()
        with store.lock:
            store.data[key] = store.data.get(key, b"") + (value.encode() if isinstance(value, str) else value)
            store.written(key)

    def check(self, keys: Sequence[str]) -> bool:
        store = self._op()
        with store.lock:
            return all(key in store.data for key in keys)

    def wait(self, keys: Sequence[str], timeout: timedelta) -> None:
        store = self._op()
        with store.baton.passed(), store.lock:
            store.wait_for(keys, timeout.total_seconds())

    def delete_key(self, key: str) -> bool:
        store = self._op()
        with store.lock:
            return store.data.pop(key, None) is not None


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


# ------------------------------------------------------------------------------------- the ranks


@dataclass
class Job:
    """What every rank checkpoints: the replicated plan (the same on every rank) and the state's tensors."""

    tensors: dict[str, torch.Tensor]
    plan: SharePlan
    pieces: list[list[Any]]
    """Each rank's pieces of the replicated tensors (``ranks.shares.partition``)."""
    claim: dict[str, Any]
    skeleton: dict[str, Any]
    """The state's skeleton, one object for every rank (the protocol only reads it)."""
    sharded: dict[str, torch.Tensor] = field(default_factory=dict)
    """Under FSDP2, the tensors each rank holds a block of: block ``rank`` of their rows as
    ``torch.chunk`` cuts them (``Shard(0)`` over every rank in order)."""

    @classmethod
    def of(cls, world: int, layers: int, state: str = "ddp") -> Job:
        """``state``: ``"ddp"`` (every tensor replicated) or ``"fsdp2"`` (every parameter and its
        optimizer state sharded; AdamW's step counts, plain tensors, replicated)."""
        everything = replicated_state(layers)
        sharded = {n: t for n, t in everything.items() if state == "fsdp2" and t.dim()}
        tensors = {n: t for n, t in everything.items() if n not in sharded}
        names = sorted(tensors)
        layout = tuple((n, str(tensors[n].dtype), tuple(tensors[n].shape)) for n in names)
        plan = SharePlan.of(layout, tensors, _Shape(world))  # type: ignore[arg-type]
        claim = replicas.report(layout, {n: replicas.fingerprint(tensors[n]) for n in names})
        return cls(tensors, plan, partition(plan.sizes, world), claim, skeleton(everything), sharded)

    def blocks(self, rank: int) -> dict[str, Box]:
        """Rank ``rank``'s block of each sharded tensor."""
        return {name: chunk_block(tuple(t.shape), len(self.pieces), rank) for name, t in self.sharded.items()}

    def commit_job(self, rank: int) -> CommitJob:
        """Rank ``rank``'s snapshot, as ``GroupCluster.select`` shares it out."""
        arrays = {p.stored_name: (self.tensors[p.name].dtype, (p.end - p.begin,)) for p in self.pieces[rank]}
        own: dict[str, Any] = {}
        for name, (dtype, shape) in PRIVATE_TENSORS.items():
            stored = private_name(name, rank)
            arrays[stored] = (dtype, shape)
            own[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "kind": PRIVATE, "parts": [stored]}
        shared = dict(self.plan.shared)
        for name, (offset, shape) in self.blocks(rank).items():
            stored, entry = private_name(name, rank), {"dtype": DTYPE_CODES[self.sharded[name].dtype],
                                                       "shape": list(self.sharded[name].shape),
                                                       "kind": SHARDED}
            arrays[stored] = (self.sharded[name].dtype, shape)
            own[name] = {**entry, "parts": [[stored, list(offset)]]}
            shared[name] = {**entry, "parts": [], "chunked": 0}  # as GroupCluster.select records FSDP2's layout
        layout = plan_layout(arrays)
        buffer = aligned_empty(layout.nbytes, False)
        buffer.zero_()
        pending = PendingSnapshot(layout, buffer, [])
        share = {"rank": own, "shared": shared, "replicas": self.claim, "plan": self.plan.digest}
        return CommitJob(STEP, 0, pending, self.skeleton, share, {"checkfreq": "sim"}, time.perf_counter())


@dataclass
class _Shape:
    world_size: int
    rank: int = 0


def chunk_block(shape: tuple[int, ...], parts: int, index: int) -> Box:
    """Block ``index`` of the ``parts`` that ``torch.chunk`` cuts the rows of a tensor of ``shape`` into."""
    step = -(-shape[0] // parts)
    begin = min(index * step, shape[0])
    return (begin, *[0] * (len(shape) - 1)), (min(step, shape[0] - begin), *shape[1:])


VOTES = 3
"""Exchanges of the vote per simulated run (one every quarter second of training in a real job)."""


def vote(peers: Peers) -> None:
    """:data:`VOTES` exchanges of the vote that agrees on *when* to checkpoint: the tree maximum
    that ``ranks.agreement.AgreedPolicy``'s vote thread runs (``ranks.collectives.tree_max``), each rank
    proposing (its wish, minus the steps to the next exchange)."""
    for _ in range(VOTES):
        tree_max(peers, torch.tensor([peers.rank % 2, -(1 + peers.rank % 7)], dtype=torch.int64))


@dataclass
class Outcome:
    """How one rank's run ended."""

    token: str
    directory: int
    commit: CommitResult
    restored: str
    restored_files: int
    fetched: int | None
    """The memory step the fetch round brought the lost machine's ranks."""
    adopted: int
    """Copies this rank took over in it."""


def _rank(rank: int, world: int, root: Path, fabric: Fabric, kv: MemoryStore, ledger: Ledger, checkpoint: Job,
          start: threading.Event, restore: bool, loss: Loss, outcomes: list[Any]) -> None:
    try:
        with fabric.baton.held():
            _run_rank(rank, world, root, fabric, kv, ledger, checkpoint, start, restore, loss, outcomes)
    except BaseException as e:  # noqa: BLE001 - reported by the caller with the rank
        outcomes[rank] = e


def _run_rank(rank: int, world: int, root: Path, fabric: Fabric, kv: MemoryStore, ledger: Ledger, checkpoint: Job,
              start: threading.Event, restore: bool, loss: Loss, outcomes: list[Any]) -> None:
    job = checkpoint.commit_job(rank)
    peers = CountingPeers(MemoryPeers(fabric, rank), ledger)
    store = StoreView(kv, ledger)
    local = CountedLocalStore(root, ledger)
    fabric.wait(start, rank, "the start")
    with ledger.phase("startup"):
        wait_for_every_rank(world, TIMEOUT_S, store, join=0)  # type: ignore[arg-type]
        agree_on_token(store, "checkfreq/groups/control+commit", rank, world, timedelta(seconds=TIMEOUT_S))  # type: ignore[arg-type]
        token, directory = meet(local, [], peers)
    with ledger.phase("memory group"):  # a memory tier's start-up: which ranks share a machine, and the copies' ring
        members = memory_group(peers, f"machine {rank // RANKS_PER_MACHINE}", STRIDE)
    leader = directory == rank
    with ledger.phase("commit"):
        committer = Committer(local, peers, leader=leader, token=token, directory_leader=directory,
                              retainer=Retainer(local, Retention(3), leader=leader))
        result = committer.run(job)
    with ledger.phase("vote"):
        vote(peers)
    kept = KeptCopies(loss.report(rank, members.receives_from), loss.copy_bytes)
    with ledger.phase("fetch round"):  # one machine lost: its ranks take their snapshots from the copies kept
        fetched = fetch_copies(Tiers([kept, LocalTier(local)]), peers, None if loss.is_lost(rank) else DISK_STEP)
    found: Found | None = None
    if restore:
        with ledger.phase("restore"):
            blocks = (lambda manifest: checkpoint.blocks(rank)) if checkpoint.sharded else None
            # no page cache shared: a network file system
            found = Restorer(Tiers([LocalTier(local)]), peers, directory_leader=directory).find(blocks=blocks)
    if leader:
        local.unlock()
    outcomes[rank] = Outcome(token, directory, result, "" if found is None else found.name,
                             0 if found is None else len(found.manifest.files), fetched, len(kept.adopted))


@dataclass
class Run:
    """One simulated world: every rank's counts by phase, how each ended, and rank 0's measurements."""

    world: int
    wall_s: float
    threads_s: float
    """Seconds to start every rank's thread."""
    ledgers: list[Ledger]
    outcomes: list[Outcome]
    manifest_bytes: int
    manifest_parse_s: float
    restored: bool
    plan_cpu_s: float
    """Rank 0's CPU for the restore's plan over N views: each file's reader, and the orders."""
    stream_cpu_s: float
    """A rank's CPU for the stream's layout and for taking the replicated tensors out of the all-gathered rows."""
    stream_bytes: int
    """What a rank receives of the all-gathered rows: every other rank's."""
    readers: dict[str, list[int]]
    """Who reads each data file from storage at restore, by the plan."""
    file_bytes: list[int]
    copies_kept: int
    """Of the copies ``benchmarks/replica_sim.py`` ran for the "snapshot copy" counts, those kept."""
    report_bytes: list[int]
    """Each rank's memory report in the fetch round (the gather to rank 0), on the wire."""
    fetch_plan_bytes: int
    """Rank 0's plan of the fetch round, on the wire (broadcast to every rank)."""
    fetch_plan_s: float
    """Rank 0's CPU for ``fetch_plan`` over every rank's report (median of repeats)."""
    fetch_decode_s: float
    """Rank 0's CPU to decode every rank's report (median of repeats)."""

    def counts(self, phase: str) -> list[Counts]:
        return [ledger.phases.get(phase, Counts()) for ledger in self.ledgers]


def simulate(world: int, *, layers: int = LAYERS, restore_up_to: int = 64, directory: str | None = None,
             state: str = "ddp", own_bytes: int = OWN_BYTES) -> Run:
    """Run start-up, one commit, the fetch round after a machine's loss and (up to ``restore_up_to``
    ranks) the restore on ``world`` rank threads, checkpointing a DDP or an FSDP2 ``state``
    (:meth:`Job.of`); count one snapshot's copies with ``own_bytes`` of each rank's own state."""
    job = Job.of(world, layers, state)
    loss = Loss(world, RANKS_PER_MACHINE)
    baton = Baton()
    ledgers = [Ledger(baton) for _ in range(world)]
    fabric, kv = Fabric(world, baton), MemoryStore(baton)
    outcomes: list[Any] = [None] * world
    restore = world <= restore_up_to
    start = threading.Event()
    with tempfile.TemporaryDirectory(prefix="checkfreq-sim-", dir=directory) as tmp:
        root = Path(tmp) / "ckpt"
        root.mkdir()
        previous = threading.stack_size(STACK_BYTES)
        time.sleep = baton.sleep  # the protocol's polls pass the baton
        gc.disable()  # else a collection of every rank's objects lands in the CPU time of whatever triggers it
        began = time.perf_counter()
        try:
            threads = [threading.Thread(target=_rank, name=f"sim-rank-{r}", daemon=True, args=(
                r, world, root, fabric, kv, ledgers[r], job, start, restore, loss, outcomes)) for r in range(world)]
            for thread in threads:
                thread.start()
        finally:
            threading.stack_size(previous)
        threads_s = time.perf_counter() - began
        start.set()
        try:
            for thread in threads:
                thread.join()
            wall_s = time.perf_counter() - began
            failed = [(r, o) for r, o in enumerate(outcomes) if not isinstance(o, Outcome)]
            if failed:
                rank, error = failed[0]
                raise RuntimeError(f"{len(failed)} simulated ranks failed; rank {rank}: {error!r}") from (
                    error if isinstance(error, BaseException) else None)
            first = outcomes[0]
            ended = {(o.token, o.directory, o.commit.step, o.restored, o.restored_files, o.fetched) for o in outcomes}
            if ended != {(first.token, first.directory, first.commit.step, first.restored, first.restored_files,
                          first.fetched)}:
                raise RuntimeError(f"the ranks ended differently: {sorted(ended, key=str)[:4]}")
            reader = LocalStore(root, create=False)
            ((_, location),) = reader.checkpoints()
            manifest_bytes = (location / "manifest.json").stat().st_size
            parse: list[float] = []
            for _ in range(3):
                began = time.thread_time()
                manifest = reader.read_manifest(location)
                parse.append(time.thread_time() - began)
            readable = _readable(reader, STEP)
            views = [readable.holdings(None, 0, [rank]) for rank in range(world)]
            began = time.thread_time()
            stream = readable.stream
            assert stream is not None
            plan = ReadPlan(readable.manifest, views, streamable=True, replicated=bool(stream.tensors))
            plan.orders()
            plan.after([{}] * world)
            plan_cpu_s = time.thread_time() - began
            readers = {name: [rank] for name, rank in plan.reader.items()}
            stream = ReplicatedStream.of(manifest)  # what every rank computes once (rank 0's plan cached its own)
            assert stream is not None
            rows = torch.zeros(world, stream.width, dtype=torch.uint8)  # each rank's row: its own file
            rows.view(torch.int64)[:, 0] = torch.arange(world)
            began = time.thread_time()
            computed = ReplicatedStream.of(manifest)
            assert computed is not None
            computed.tensors_of(rows)
            stream_cpu_s = time.thread_time() - began
            stream_bytes = stream.width * (world - 1)  # every other rank's row
            file_bytes = [manifest.files[name]["size"] for name in sorted(manifest.files)]
        finally:
            time.sleep = _SLEEP
            gc.enable()
    kept = _count_copies(world, layers, own_bytes, ledgers, directory)
    reports = loss.reports()
    fetch_plan_s, fetch_decode_s = plan_seconds(reports)
    return Run(world, wall_s, threads_s, ledgers, outcomes, manifest_bytes, statistics.median(parse), restore,
               plan_cpu_s, stream_cpu_s, stream_bytes, readers, file_bytes, kept,
               [message_bytes(report.to_wire()) for report in reports], message_bytes(fetch_plan(reports).to_wire()),
               fetch_plan_s, fetch_decode_s)


def _count_copies(world: int, layers: int, own_bytes: int, ledgers: list[Ledger], directory: str | None) -> int:
    """Each rank's counts for one snapshot's copies (:data:`COPY_PHASE`), from real copies of the
    first and the last machine's snapshots (``benchmarks/replica_sim.py``); how many were kept."""
    if world < 2 * RANKS_PER_MACHINE:  # one machine: no copies
        return 0
    copied = copy_counts(world, measured_senders(world, RANKS_PER_MACHINE), per_machine=RANKS_PER_MACHINE,
                         layers=layers, own_bytes=own_bytes, directory=directory)
    for ledger, link in zip(ledgers, per_snapshot(world, RANKS_PER_MACHINE, copied), strict=True):
        ledger.phases[COPY_PHASE] = Counts(messages_out=link.messages_out, messages_in=link.messages_in,
                                           bytes_out=link.bytes_out, bytes_in=link.bytes_in, peers=link.peers)
    return len(copied.kept)


def _readable(store: LocalStore, step: int) -> Readable:
    """What a rank of a shared directory has of checkpoint ``step`` at restore, by the restorer's own
    code (on one shared directory every rank's is rank 0's)."""
    restorer = Restorer(Tiers([LocalTier(store)]), Solo())
    restorer._locations = {TierName.LOCAL: dict(store.checkpoints())}
    readable = restorer._readable(step)
    assert not isinstance(readable, str), readable
    return readable


# ------------------------------------------------------------------------------------- the report


def _spread(values: Sequence[float]) -> tuple[float, float]:
    """(median, maximum) of ``values`` (0 for none)."""
    return (statistics.median(values), max(values)) if values else (0.0, 0.0)


def rows(run: Run) -> list[dict[str, Any]]:
    """One row per (phase, count): rank 0's value, and the median and maximum over the other ranks."""
    out = []
    for phase in PHASES:
        counts = run.counts(phase)
        if phase == "restore" and not run.restored or phase == COPY_PHASE and not run.copies_kept:
            continue
        metrics = {
            "messages in": lambda c, r: c.messages_in, "messages out": lambda c, r: c.messages_out,
            "bytes in": lambda c, r: c.bytes_in, "bytes out": lambda c, r: c.bytes_out,
            "CPU ms": lambda c, r: 1000 * c.cpu_s, "store operations": lambda c, r: c.store_ops,
            "of which polls": lambda c, r: c.store_polls,
            "connections": lambda c, r: c.connections(r, run.world), "files read": lambda c, r: len(c.files_read),
            "files looked up": lambda c, r: c.lookups,
        }
        if phase == COPY_PHASE:
            metrics = {k: m for k, m in metrics.items() if k not in ("CPU ms", "files read", "files looked up")}
        for name, metric in metrics.items():
            others = [metric(c, r) for r, c in enumerate(counts) if r]
            median, most = _spread(others)
            out.append({"world": run.world, "phase": phase, "count": name, "rank0": metric(counts[0], 0),
                        "median": median, "max": most})
    return out


def summary(run: Run) -> dict[str, Any]:
    """The numbers the acceptance criteria read, for one world."""
    commit, startup = run.counts("commit"), run.counts("startup")
    others = range(1, run.world)
    total = sum(run.file_bytes)
    return {
        "world": run.world, "wall_s": round(run.wall_s, 2), "threads_s": round(run.threads_s, 2),
        **{f"{phase}_wall_s": round(run.counts(phase)[0].wall_s, 2) for phase in PHASES},
        "commit_bytes_max": max(commit[r].bytes_in + commit[r].bytes_out for r in others),
        "commit_cpu_ms_median": 1000 * statistics.median(commit[r].cpu_s for r in others),
        "commit_cpu_ms_max": 1000 * max(commit[r].cpu_s for r in others),
        "rank0_commit_cpu_s": commit[0].cpu_s,
        "startup_store_ops_max": max(startup[r].store_ops - startup[r].store_polls for r in others),
        "manifest_bytes": run.manifest_bytes, "manifest_parse_ms": 1000 * run.manifest_parse_s,
        "restore_plan_ms": 1000 * run.plan_cpu_s,
        "restore_readers": sorted({len(ranks) for ranks in run.readers.values()}),
        "restore_each_reads_its_own": all(
            ranks == [int(name[len("rank"):].split(".")[0])] for name, ranks in run.readers.items()
        ),
        "restore_files_per_rank": max(sum(1 for ranks in run.readers.values() if r in ranks) for r in range(run.world)),
        "restore_stream_ms": 1000 * run.stream_cpu_s,
        "restore_bytes_in_max": max(c.bytes_in for c in run.counts("restore")) if run.restored else None,
        "restore_bytes_in_planned": run.stream_bytes,
        "restore_bytes_in_whole_files": total - min(run.file_bytes),  # every file but its own, as before
        **_replica_summary(run),
    }


def _replica_summary(run: Run) -> dict[str, Any]:
    """The copies' numbers: each snapshot's per rank (the most of any rank), and the fetch round's."""
    copy, fetch = run.counts(COPY_PHASE), run.counts("fetch round")
    others = range(1, run.world)
    return {
        "copies_kept": run.copies_kept,
        "copy_messages_max": max(c.messages_in + c.messages_out for c in copy),
        "copy_bytes_max": max(c.bytes_in + c.bytes_out for c in copy),
        "copy_store_ops_max": max(c.store_ops for c in copy),
        "copy_connections_max": max(c.connections(r, run.world) for r, c in enumerate(copy)),
        "fetch_report_bytes_max": max(run.report_bytes),
        "fetch_gather_bytes": sum(run.report_bytes[1:]),
        "fetch_plan_bytes": run.fetch_plan_bytes,
        "fetch_plan_ms": 1000 * run.fetch_plan_s, "fetch_decode_ms": 1000 * run.fetch_decode_s,
        "fetch_rank0_cpu_ms": 1000 * fetch[0].cpu_s,
        "fetch_messages_max": max(fetch[r].messages_in + fetch[r].messages_out for r in others),
        "fetch_bytes_max": max(fetch[r].bytes_in + fetch[r].bytes_out for r in others),
        "fetch_connections_max": max(fetch[r].connections(r, run.world) for r in others),
        "fetched": sorted({str(o.fetched) for o in run.outcomes}),
        "adopted": sum(o.adopted for o in run.outcomes),
    }


REPLICA_COLUMNS = {
    "copy_messages_max": "copy: messages per rank", "copy_bytes_max": "copy: bytes per rank",
    "copy_store_ops_max": "copy: store operations", "copy_connections_max": "copy: connections",
    "fetch_report_bytes_max": "fetch: report B", "fetch_gather_bytes": "fetch: rank 0 gathers B",
    "fetch_plan_bytes": "fetch: plan B", "fetch_plan_ms": "fetch_plan ms", "fetch_decode_ms": "decode ms",
    "fetch_rank0_cpu_ms": "fetch: rank 0 CPU ms", "fetch_messages_max": "fetch: messages per rank",
    "fetch_connections_max": "fetch: connections",
}
"""The replicas table's columns (:func:`replica_table`): each a key of :func:`summary`."""


def replica_table(sums: Sequence[dict[str, Any]]) -> list[str]:
    """The copies' figures, one row per N: per rank the most of any rank (in + out), for one
    snapshot's copy and for the fetch round after a machine's loss; rank 0's gather and plan."""
    lines = ["| N | " + " | ".join(REPLICA_COLUMNS.values()) + " |", "| --- " * (len(REPLICA_COLUMNS) + 1) + "|"]
    for s in sums:
        lines.append(f"| {s['world']:,} | " + " | ".join(_number(s[k]) for k in REPLICA_COLUMNS) + " |")
    return lines


def verdicts(sums: list[dict[str, Any]], fsdp2: dict[int, int], layers: int) -> list[tuple[str, bool, str]]:
    """Each acceptance criterion: its name, whether the numbers meet it, and the numbers."""
    small, large = sums[0], sums[-1]
    per_rank_bytes = large["commit_bytes_max"] <= 2 * small["commit_bytes_max"]
    per_rank_cpu = large["commit_cpu_ms_median"] <= 2 * small["commit_cpu_ms_median"]
    ops = {s["startup_store_ops_max"] for s in sums}
    largest = max(s["world"] for s in sums)
    manifests = max(large["manifest_bytes"], fsdp2[largest])
    n0, n1 = f"N = {small['world']:,}", f"N = {large['world']:,}"
    copied = [s for s in sums if s["copies_kept"]] or [small]  # the worlds of more than one machine
    c0, c1 = copied[0], copied[-1]
    return [
        ("a rank's bytes per checkpoint within 2x", per_rank_bytes,
         f"most of a rank other than 0 (in + out): {small['commit_bytes_max']:,} B at {n0}, "
         f"{large['commit_bytes_max']:,} B at {n1}"),
        ("a rank's CPU per checkpoint within 2x", per_rank_cpu,
         f"median of the ranks other than 0: {small['commit_cpu_ms_median']:.2f} ms at {n0}, "
         f"{large['commit_cpu_ms_median']:.2f} ms at {n1}"),
        ("rank 0's commit work <= 1 s", large["rank0_commit_cpu_s"] <= 1.0,
         f"rank 0's CPU in Committer.run at {n1}: {large['rank0_commit_cpu_s']:.3f} s"),
        ("start-up store operations per rank constant", len(ops) == 1,
         f"a rank other than 0, polls left out: {sorted(ops)} at every N"),
        ("manifest <= 16 MB (DDP and FSDP2)", manifests <= 16_000_000,
         f"{8 * layers} tensors at N = {largest:,}: DDP {large['manifest_bytes']:,} B, FSDP2 {fsdp2[largest]:,} B"),
        ("a rank's copy per snapshot flat (messages; bytes within 1%; <= 2 connections; no store operation)",
         flat_copies(copied),
         f"the most of any rank (in + out): {c0['copy_messages_max']} messages, {c0['copy_bytes_max']:,} B, "
         f"{c0['copy_connections_max']} connections at N = {c0['world']:,}; {c1['copy_messages_max']}, "
         f"{c1['copy_bytes_max']:,} B, {c1['copy_connections_max']} at N = {c1['world']:,}; store operations: "
         f"{max(s['copy_store_ops_max'] for s in sums)}"),
        ("rank 0's fetch_plan <= 1 s", large["fetch_plan_ms"] <= 1000,
         f"one machine of {RANKS_PER_MACHINE} lost, at {n1}: {large['fetch_plan_ms']:.1f} ms (decoding the reports: "
         f"{large['fetch_decode_ms']:.1f} ms)"),
    ]


def flat_copies(sums: Sequence[dict[str, Any]]) -> bool:
    """Whether a rank's copy of a snapshot costs the same at every size of ``sums``: the same
    messages, bytes within 1% (the digits of rank numbers in its manifest), a partner each way
    (one connection where two machines copy to each other), no store operation; False without copies."""
    first = sums[0]
    return all(
        s["copies_kept"] and s["copy_messages_max"] == first["copy_messages_max"] and s["copy_store_ops_max"] == 0
        and s["copy_connections_max"] <= 2 and abs(s["copy_bytes_max"] - first["copy_bytes_max"]) <= first[
            "copy_bytes_max"] / 100
        for s in sums
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default=WORLDS, help="comma-separated numbers of ranks")
    parser.add_argument("--layers", type=int, default=LAYERS, help="linear layers of the DDP model (8 tensors each)")
    parser.add_argument("--restore-up-to", type=int, default=64, help="run the restore on every rank up to this N")
    parser.add_argument("--state", choices=("ddp", "fsdp2"), default="ddp",
                        help="what the ranks checkpoint and restore")
    parser.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None,
                        help="where the checkpoint directory is made (a tmpfs keeps 16k files' writes cheap)")
    parser.add_argument("--own-bytes", type=int, default=OWN_BYTES,
                        help="each rank's own (not replicated) state in a memory snapshot, copied to another machine")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    sums = []
    print("| N | phase | count | rank 0 | other ranks: median | max |\n| --- | --- | --- | --- | --- | --- |")
    for world in worlds:
        run = simulate(world, layers=args.layers, restore_up_to=args.restore_up_to, directory=args.dir,
                       state=args.state, own_bytes=args.own_bytes)
        for row in rows(run):
            print(f"| {row['world']:,} | {row['phase']} | {row['count']} | {_number(row['rank0'])} | "
                  f"{_number(row['median'])} | {_number(row['max'])} |", flush=True)
        sums.append(summary(run))
        print(json.dumps(sums[-1]), flush=True)
    fsdp2 = {world: costs(world, "fsdp2", args.layers)["manifest_bytes"] for world in worlds}
    print("\n".join(replica_table(sums)))
    for name, ok, numbers in verdicts(sums, fsdp2, args.layers):
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {numbers}")


def _number(value: float) -> str:
    return f"{value:,.2f}" if isinstance(value, float) and not value.is_integer() else f"{int(value):,}"


if __name__ == "__main__":
    main()
