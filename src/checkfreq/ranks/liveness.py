"""Whether the other ranks are alive: heartbeats in the job's key-value store, the job's failure, and
the bound on how long any rank waits for another.

Every wait on another rank (a commit's rounds, an upload's, the restore's exchanges, the vote,
the start-up exchanges) is bounded by the *failure timeout*, measured from the last sign of life
of the ranks it waits for, not from the start of the wait: a rank busy writing a large file for
minutes is alive, a rank whose process is gone is not. The signs of life:

* **heartbeats**: each rank's heartbeat thread adds 1 to a counter of its own in the job's store
  every :attr:`Liveness.interval` (a quarter of the failure timeout, at most 5 s). A rank waiting
  longer than a poll reads the counters of the ranks it waits for (at most once per interval each);
  a counter that has not moved for the failure timeout means its rank is lost. A rank's cost is two
  store operations per interval (its counter, and a look at the job's failure), whatever the number
  of ranks, plus, only while a wait lasts, one per awaited rank per interval (rank 0 awaits every
  rank in a commit's gather, as it already receives a message from each); the store serves
  ``2 N / interval`` operations per second.
* **the job's failure**: a rank that gives up (it lost a peer, or it leaves on an error with its
  Checkpointer open) writes why under one key; every rank's heartbeat thread reads that key at each
  beat, and each wait in progress raises :class:`~checkfreq.errors.PeerLostError` at once with the
  first rank's words. A rank that left therefore never keeps its peers waiting for the timeout. The
  rank that wrote it goes on leaving once the others have read it (each counts itself under a second
  key), at most a heartbeat interval later: when the store lives in its process, the others would
  otherwise see only its connection close, and name it, not the rank that was lost.
* **a closed connection**: gloo's "Connection closed by peer" on a message to or from one rank names
  that rank, whether gloo refuses the message as it is posted (the connection had closed before)
  or as it is awaited. In an exchange with several ranks (an all-gather), where gloo does not say
  which, the rank named is the first whose heartbeat is silent for :data:`SILENT_BEATS`
  heartbeat intervals: a rank that died is named within a few intervals, not the failure timeout.
* **a process of this machine that ended** (:mod:`checkfreq.ranks.processes`): an awaited rank whose
  process is seen gone for a heartbeat interval is lost. gloo does not fail an all-gather whose rank
  was killed; this ends it, and the ranks of other machines learn it as the job's failure.

Once this process learns that the job failed (a peer lost, or another rank's failure published), it
ends itself (``os._exit(1)``) if it is still running :data:`EXIT_GRACE` times the failure timeout
later, whatever its threads are blocked in (a training thread stuck in a collective with a vanished
node, say), so that torchrun restarts the job. A rank leaving on its own error is not ended.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from checkfreq.errors import PeerLostError
from checkfreq.ranks.processes import ProcessIdentity, has_ended, this_process

log = logging.getLogger("checkfreq.liveness")

MAX_INTERVAL_S = 5.0
"""The longest time between two heartbeats, whatever the failure timeout."""
EXIT_GRACE = 1.0
"""A process that knows the job failed ends itself this many failure timeouts later if still running."""
_FAILED = "failed"
_READ = "failed/read"
"""How many ranks have read the published failure."""
SILENT_BEATS = 2.5
"""Where a rank is already known to be gone (a connection closed in a wait on several ranks, a peer's
error in training), the heartbeat intervals a rank stays silent to be named the lost one: the wait
ends within a few beats, not the failure timeout (a live rank beats every interval)."""
READ_MARGIN_S = 0.5
"""Beyond a heartbeat interval, how long the rank that published the job's failure waits for the
others to read it before it goes on leaving."""


@dataclass(frozen=True)
class Whoami:
    """Rank → the job's key-value store, at start-up: where this rank runs (errors name a lost rank
    by it; ranks of the same machine see at once that its process ended)."""

    host: str
    pid: int
    process: ProcessIdentity | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"host": self.host, "pid": self.pid}
        if self.process is not None:
            wire["process"] = self.process.to_wire()
        return wire

    @classmethod
    def from_wire(cls, wire: Any) -> Whoami:
        process = None if wire.get("process") is None else ProcessIdentity.from_wire(wire["process"])
        return cls(str(wire["host"]), int(wire["pid"]), process)


class Liveness:
    """This rank's heartbeat, and what it knows of the other ranks' (one per :class:`GroupCluster`).

    Args:
        store: a store private to this incarnation of the job (under the groups' token).
        rank, size: this rank and the number of ranks.
        timeout: the failure timeout, in seconds.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: float) -> None:
        self.store, self.rank, self.size, self.timeout = store, rank, size, timeout
        self.interval = min(MAX_INTERVAL_S, timeout / 4)
        self.failure: PeerLostError | None = None
        """Why the job failed, once this process knows it."""
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (its counter, when it last moved)
        self._read: dict[int, float] = {}  # rank -> when its counter was last read
        self._processes: dict[int, ProcessIdentity | None] = {}  # rank -> its process, if this one can see it
        self._ended: dict[int, float] = {}  # rank -> when its process was first seen ended
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._exit_timer: threading.Timer | None = None
        whoami = Whoami(socket.gethostname(), os.getpid(), this_process())
        store.set(f"who/{rank}", json.dumps(whoami.to_wire()))
        store.add(f"alive/{rank}", 1)
        self._thread = threading.Thread(target=self._beat, name="checkfreq-heartbeat", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ asked by waiting threads

    def check(self, awaited: Iterable[int], activity: str, silence: float | None = None) -> None:
        """Raise :class:`PeerLostError` if the job failed, or if a rank of ``awaited`` gave no sign of
        life for ``silence`` seconds (the failure timeout if None). Called every poll of a wait;
        reads a counter at most once per interval."""
        silence = self.timeout if silence is None else silence
        if self.failure is not None:
            raise self.failure
        now = time.monotonic()
        awaited = [r for r in awaited if r != self.rank]
        for rank in awaited:
            self._check_process(rank, activity, now)
        due = [r for r in awaited if now - self._read.get(r, -1e9) >= self.interval]
        for rank in due:
            try:
                count = self.store.add(f"alive/{rank}", 0)
                if rank not in self._processes and (who := self._whoami(rank)) is not None:
                    self._processes[rank] = who.process
            except RuntimeError as e:  # the store is gone: so is the job
                raise self.give_up(f"the job's key-value store stopped answering ({e}) during {activity}") from e
            self._read[rank] = now
            seen = self._seen.get(rank)
            if seen is None or seen[0] != count:
                self._seen[rank] = (count, now)
            elif now - seen[1] > silence:
                raise self.give_up(f"{self.describe(rank)} stopped answering during {activity}", lost=rank)

    def _check_process(self, rank: int, activity: str, now: float) -> None:
        """Raise :class:`PeerLostError` if ``rank`` runs on this machine and its process ended a
        heartbeat interval ago or more (what it sent before it ended, its last word at a close
        included, has had time to arrive)."""
        process = self._processes.get(rank)
        if process is None or not has_ended(process):
            return
        since = self._ended.setdefault(rank, now)
        if now - since >= self.interval:
            if (published := self._published()) is not None:  # it left after telling why the job failed
                raise published
            raise self.give_up(f"{self.describe(rank)} ended (its process is gone) during {activity}", lost=rank)

    def closed(self, rank: int | None, activity: str, error: BaseException) -> PeerLostError:
        """The error for a wait that failed with ``error`` (gloo's): ``rank`` closed its connection
        (None: the wait was on several ranks), unless the job's failure already says why."""
        known = self.failure or self._published()
        if known is not None:
            return known
        if rank is None:  # which one: a connection closed, so the first whose heartbeats stop for a few beats
            silence = SILENT_BEATS * self.interval
            found = self.find_lost(activity, silence + 2 * self.interval, silence)
            return found or self.give_up(f"a rank closed its connection during {activity} ({error})")
        return self.give_up(
            f"{self.describe(rank)} closed its connection during {activity}: it died or left", lost=rank
        )

    # ------------------------------------------------------------------ giving up

    def give_up(self, reason: str, *, lost: int | None = None, end_process: bool = True) -> PeerLostError:
        """Record that the job failed (``reason``: what happened, to whom; ``lost``: the rank lost,
        if known), tell every rank through the store, and arm the exit (unless ``end_process`` is
        False: this rank leaves by its own error, which its caller may handle); returns the error to
        raise. The first reason stays."""
        published = False
        with self._lock:
            if self.failure is None:
                words = f"{reason} (seen by rank {self.rank})"
                self.failure = self._error(words)
                log.error("%s", self.failure)
                try:  # one rank publishes, even where several find the loss at once
                    published = self.store.compare_set(_FAILED, "", words) == words.encode()
                    if not published:
                        self.store.add(_READ, 1)
                except RuntimeError:
                    pass  # the store is gone: every rank finds that out by itself
                if end_process:
                    self._arm_exit()
            failure = self.failure
        if published:
            self._let_ranks_read(self.size - 1 - (lost is not None))
        return failure

    def _let_ranks_read(self, readers: int) -> None:
        """Return once ``readers`` ranks (every other rank, the lost one aside) have read the
        failure this rank published, or a heartbeat interval later: the store may live in this
        process (a worker hosts it when torchrun does not share its own) and end with it, and a rank
        that had not read why the job failed would then name this rank, which only left, as the one
        lost."""
        deadline = time.monotonic() + self.interval + READ_MARGIN_S
        while time.monotonic() < deadline:
            try:
                if self.store.add(_READ, 0) >= readers:
                    return
            except RuntimeError:
                return
            time.sleep(0.02)

    def describe(self, rank: int) -> str:
        """``rank 3 (host, pid 1234)``, as the rank published it at start-up."""
        try:
            who = self._whoami(rank)
        except RuntimeError:
            who = None
        return f"rank {rank}" if who is None else f"rank {rank} ({who.host}, pid {who.pid})"

    def _whoami(self, rank: int) -> Whoami | None:
        """What ``rank`` published at start-up, or None if it did not (yet) or it cannot be read;
        raises the store's ``RuntimeError``."""
        if not self.store.check([f"who/{rank}"]):
            return None
        try:
            return Whoami.from_wire(json.loads(self.store.get(f"who/{rank}")))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def stop(self) -> None:
        """Stop the heartbeat (the Checkpointer is closed)."""
        self._stop.set()
        if self._exit_timer is not None:
            self._exit_timer.cancel()

    # ------------------------------------------------------------------ internals

    def _error(self, reason: str) -> PeerLostError:
        return PeerLostError(
            f"{reason}; rank {self.rank} gives up (failure timeout {self.timeout:g} s) so that torchrun can "
            "restart the job"
        )

    def _published(self) -> PeerLostError | None:
        """The job's failure as another rank published it, if one did (adopted as this rank's)."""
        try:
            reason = self.store.get(_FAILED).decode() if self.store.check([_FAILED]) else None
        except RuntimeError:
            return None
        if reason is None:
            return None
        with self._lock:
            if self.failure is None:
                self.failure = self._error(reason)
                log.error("%s", self.failure)
                self._arm_exit()
                try:
                    self.store.add(_READ, 1)  # the rank that published it may leave now
                except RuntimeError:
                    pass
            return self.failure

    def find_lost(self, activity: str, seconds: float, silence: float | None = None) -> PeerLostError | None:
        """The job's failure, found by watching every other rank's heartbeat (and the published
        failure) for at most ``seconds``, a rank silent for ``silence`` seconds (the failure timeout
        if None) being lost, or None if every rank stays alive that long."""
        deadline = time.monotonic() + seconds
        others = [r for r in range(self.size) if r != self.rank]
        while time.monotonic() < deadline:
            try:
                self.check(others, activity, silence)
            except PeerLostError as e:
                return e
            time.sleep(min(0.1, self.interval))
        return None

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.store.add(f"alive/{self.rank}", 1)
                if self.failure is None:
                    self._published()
            except RuntimeError as e:
                log.debug("heartbeat of rank %d failed: %s", self.rank, e)

    def _arm_exit(self) -> None:
        if self._exit_timer is None and not self._stop.is_set():
            self._exit_timer = threading.Timer(EXIT_GRACE * self.timeout, _exit, args=(self,))
            self._exit_timer.daemon = True
            self._exit_timer.start()


def _exit(liveness: Liveness) -> None:
    """The process is still running a failure timeout after it knew the job failed: end it."""
    log.critical("%s; ending this process now", liveness.failure)
    logging.shutdown()
    os._exit(1)
