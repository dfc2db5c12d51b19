"""The simulated network and key-value store of ``benchmarks/protocol_sim.py``: every rank on a thread of
its own, one computing at a time (:class:`Baton`), collectives matched by their order and
point-to-point messages by (sender, receiver) (:class:`Fabric`, :class:`MemoryPeers`), and the
key-value store with the operations that start-up uses (:class:`MemoryStore`). What each rank's
calls cost is counted apart (``benchmarks/sim_counts.py``)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch

TIMEOUT_S = 1800.0


class Gathered(list):
    """A gathered or all-gathered list that knows its bytes on the wire (summed by the transport
    as it carries them, so that counting costs no rank a second encoding of every message)."""

    nbytes: int


REAL_SLEEP = time.sleep


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
            REAL_SLEEP(seconds)


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
                    raise RuntimeError(
                        f"simulated rank {self.rank} waited more than {self.fabric.timeout:.0f} s for rank {sender}"
                    )
                data = queue.popleft()
            if len(data) != size:
                raise RuntimeError(f"rank {self.rank} expected {size} bytes from rank {sender}, got {len(data)}")
            return torch.frombuffer(bytearray(data), dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)


# --------------------------------------------------------------------------------- the key-value store


class MemoryStore:
    """The job's key-value store, in memory, shared by the simulated ranks, with the operations of
    ``torch.distributed.Store`` that start-up uses. A write wakes only the ranks waiting for its key
    (thousands of ranks wait at once at start-up)."""

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

    def set(self, key: str, value: str | bytes) -> None:
        self.multi_set([key], [value])

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        with self.lock:
            for key, value in zip(keys, values, strict=True):
                self.data[key] = value.encode() if isinstance(value, str) else value
                self.written(key)

    def get(self, key: str) -> bytes:
        with self.baton.passed(), self.lock:
            self.wait_for([key], TIMEOUT_S)
            return self.data[key]

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            value = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(value).encode()
            self.written(key)
            return value

    def append(self, key: str, value: str | bytes) -> None:
        with self.lock:
            self.data[key] = self.data.get(key, b"") + (value.encode() if isinstance(value, str) else value)
            self.written(key)

    def check(self, keys: Sequence[str]) -> bool:
        with self.lock:
            return all(key in self.data for key in keys)

    def wait(self, keys: Sequence[str], timeout: timedelta) -> None:
        with self.baton.passed(), self.lock:
            self.wait_for(keys, timeout.total_seconds())

    def delete_key(self, key: str) -> bool:
        with self.lock:
            return self.data.pop(key, None) is not None
