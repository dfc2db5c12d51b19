"""Liveness bookkeeping over a dict-backed store, with the clock the checks read under the test's control."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest

import checkfreq.ranks.liveness as liveness_module
from checkfreq.errors import PeerLostError
from checkfreq.ranks.liveness import Liveness

TIMEOUT = 100.0
"""The failure timeout of the Liveness objects whose clock the test moves: their heartbeat thread
beats every 5 s of real time, too rarely to matter during a test."""


class DictStore:
    """The calls Liveness makes on a ``torch.distributed.Store``: set, get, add, compare_set, check."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.broken = False
        self._lock = threading.Lock()

    def set(self, key: str, value: str | bytes) -> None:
        self._answer()
        with self._lock:
            self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        self._answer()
        with self._lock:
            return self.data[key]

    def add(self, key: str, amount: int) -> int:
        self._answer()
        with self._lock:
            value = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(value).encode()
            return value

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._answer()
        with self._lock:
            current = self.data.get(key)
            if (current is None and expected == "") or current == expected.encode():
                self.data[key] = desired.encode()
            return self.data[key]

    def check(self, keys: list[str]) -> bool:
        self._answer()
        with self._lock:
            return all(key in self.data for key in keys)

    def _answer(self) -> None:
        if self.broken:
            raise RuntimeError("Connection reset by peer")


class Clock:
    """``time`` for the liveness module: ``monotonic`` is the test's, ``sleep`` advances it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(liveness_module, "time", fake)
    return fake


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> list[Liveness]:
    """The processes that would have ended themselves (never this test's)."""
    ended: list[Liveness] = []
    monkeypatch.setattr(liveness_module, "_exit", ended.append)
    return ended


@pytest.fixture
def store() -> DictStore:
    return DictStore()


@pytest.fixture
def made(exits: list[Liveness]) -> Iterator[list[Liveness]]:
    """Every Liveness a test makes, stopped (and its exit disarmed) at the end."""
    objects: list[Liveness] = []
    yield objects
    for liveness in objects:
        liveness.stop()


def _rank(made: list[Liveness], store: DictStore, rank: int, size: int, timeout: float = TIMEOUT) -> Liveness:
    liveness = Liveness(store, rank, size, timeout)  # type: ignore[arg-type]
    made.append(liveness)
    return liveness


def _peer(store: DictStore, rank: int) -> None:
    """Another rank's start-up, as Liveness publishes it."""
    store.set(f"who/{rank}", json.dumps({"host": f"node{rank}", "pid": 100 + rank}))
    store.add(f"alive/{rank}", 1)


def test_a_silent_rank_is_named_after_the_timeout_and_a_live_one_is_not(
    store: DictStore, clock: Clock, made: list[Liveness]
) -> None:
    me = _rank(made, store, 0, 3)
    _peer(store, 1)
    _peer(store, 2)
    while clock.now < 1000.0 + TIMEOUT * 0.9:  # rank 1 beats, rank 2 is silent: within the timeout, all is well
        me.check([1, 2], "a commit")
        store.add("alive/1", 1)
        clock.sleep(me.interval)
    with pytest.raises(PeerLostError) as lost:
        for _ in range(100):
            me.check([1, 2], "a commit")
            store.add("alive/1", 1)
            clock.sleep(me.interval)
    message = str(lost.value)
    assert "rank 2 (node2, pid 102) stopped answering during a commit" in message
    assert "rank 1" not in message.replace("seen by rank 0", "")
    assert clock.now - 1000.0 > TIMEOUT  # not before the failure timeout
    assert me.failure is lost.value
    with pytest.raises(PeerLostError) as again:  # every later wait fails at once, with the first reason
        me.check([1], "an upload")
    assert again.value is lost.value


def test_a_silent_rank_not_awaited_is_not_named(store: DictStore, clock: Clock, made: list[Liveness]) -> None:
    me = _rank(made, store, 0, 3)
    _peer(store, 1)
    _peer(store, 2)
    for _ in range(200):
        me.check([1], "a restore")
        store.add("alive/1", 1)
        clock.sleep(me.interval)
    assert me.failure is None
    assert me.find_lost("a restore", 0.0) is None


def test_a_rank_busy_for_longer_than_the_timeout_but_beating_is_alive(
    store: DictStore, clock: Clock, made: list[Liveness]
) -> None:
    me = _rank(made, store, 1, 2)
    _peer(store, 0)
    for _ in range(10 * int(TIMEOUT / me.interval)):
        me.check([0], "a long write")
        store.add("alive/0", 1)
        clock.sleep(me.interval / 3)  # checks more often than the interval: counters are read once per interval
    assert me.failure is None


def test_a_published_failure_is_seen_by_the_other_ranks(
    store: DictStore, exits: list[Liveness], made: list[Liveness]
) -> None:
    first = _rank(made, store, 0, 2, timeout=600.0)
    other = _rank(made, store, 1, 2, timeout=0.4)  # its heartbeat thread reads the failure every 0.1 s
    error = first.give_up("rank 3 vanished", end_process=False)
    assert "rank 3 vanished (seen by rank 0)" in str(error)
    deadline = time.monotonic() + 60
    while other.failure is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert other.failure is not None and "rank 3 vanished (seen by rank 0)" in str(other.failure)
    with pytest.raises(PeerLostError, match="rank 3 vanished"):
        other.check([0], "a vote")
    assert exits == [] or exits == [other]  # the other rank's exit is armed, after its failure timeout


def test_closed_connection_adopts_a_published_failure_at_once(
    store: DictStore, clock: Clock, made: list[Liveness]
) -> None:
    first = _rank(made, store, 0, 3)
    second = _rank(made, store, 1, 3)
    first.give_up("rank 2 lost its node", end_process=False)
    error = second.closed(2, "an upload", RuntimeError("Connection closed by peer"))
    assert "rank 2 lost its node (seen by rank 0)" in str(error)
    assert second.failure is error


def test_closed_connection_names_the_rank(store: DictStore, clock: Clock, made: list[Liveness]) -> None:
    me = _rank(made, store, 0, 3)
    _peer(store, 2)
    error = me.closed(2, "the restore", RuntimeError("Connection closed by peer"))
    assert "rank 2 (node2, pid 102) closed its connection during the restore" in str(error)
    assert "rank 2 (node2, pid 102) closed" in store.get("failed").decode()  # told to every rank
    assert me.describe(7) == "rank 7"  # a rank that never started says no more


def test_a_lost_store_is_a_lost_job(store: DictStore, clock: Clock, made: list[Liveness]) -> None:
    me = _rank(made, store, 0, 2)
    store.broken = True
    with pytest.raises(PeerLostError, match="key-value store stopped answering"):
        me.check([1], "a commit")


def test_the_first_reason_stays(store: DictStore, clock: Clock, made: list[Liveness]) -> None:
    me = _rank(made, store, 0, 2)
    first = me.give_up("first", end_process=False)
    assert me.give_up("second", end_process=False) is first
    assert store.get("failed").decode() == "first (seen by rank 0)"


class BeatingClock(Clock):
    """A clock whose time passing makes the live ranks beat, once per ``beat`` seconds."""

    def __init__(self, store: DictStore, alive: list[int], beat: float) -> None:
        super().__init__()
        self.store, self.alive, self.beat, self._next = store, alive, beat, self.now + beat

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        while self.now >= self._next:
            for rank in self.alive:
                self.store.add(f"alive/{rank}", 1)
            self._next += self.beat


@pytest.mark.parametrize("dead", [[3], []], ids=["a rank died", "none died"])
def test_a_closed_connection_in_an_all_gather_ends_within_a_few_beats_not_the_timeout(
    store: DictStore, made: list[Liveness], monkeypatch: pytest.MonkeyPatch, dead: list[int]
) -> None:
    """gloo does not say which rank of an all-gather closed its connection: the one whose heartbeat
    stops is named a few beats later, and if every rank still beats the wait ends as soon."""
    me = _rank(made, store, 0, 4)
    alive = [r for r in (1, 2, 3) if r not in dead]
    for rank in (1, 2, 3):
        _peer(store, rank)
    clock = BeatingClock(store, alive, me.interval)
    monkeypatch.setattr(liveness_module, "time", clock)
    error = me.closed(None, "the restore's exchange", RuntimeError("Connection closed by peer"))
    waited = clock.now - 1000.0
    if dead:
        assert "rank 3 (node3, pid 103) stopped answering during the restore's exchange" in str(error)
    else:
        assert "a rank closed its connection during the restore's exchange" in str(error)
    assert not any(f"rank {r} (" in str(error) for r in alive)  # a rank that beats is never named
    watched = (liveness_module.SILENT_BEATS + 2) * me.interval
    read_by_the_others = me.interval + liveness_module.READ_MARGIN_S  # once named, the others read why
    assert waited <= watched + read_by_the_others + 0.2 < TIMEOUT / 3
    assert me.failure is error
