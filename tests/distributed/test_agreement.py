"""Agreeing on when to checkpoint: two real gloo ranks, and ranks as threads exchanging messages through
queues, policies with plain scripted answers."""

from __future__ import annotations

import json
import math
import os
import queue
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from checkfreq.errors import CheckfreqError, PeerLostError
from checkfreq.policies import DecisionContext
from checkfreq.ranks.agreement import MAX_VOTE_STEPS, VOTE_ACTIVITY, VOTE_SECONDS, AgreedPolicy, vote_steps
from checkfreq.ranks.collectives import TREE_ARITY, GroupPeers, tree_max
from checkfreq.ranks.liveness import Liveness
from helpers import spawn_ranks

STEPS = 120


class Scripted:
    """Says yes at the given steps only, like an epoch boundary that lasts one step; plans ``interval``."""

    def __init__(self, yes_at: list[int], interval: int) -> None:
        self.yes_at = set(yes_at)
        self.interval = interval
        self.asked: list[int] = []

    def should_save(self, ctx: DecisionContext) -> bool:
        self.asked.append(ctx.step)
        return ctx.step in self.yes_at


def _ctx(step: int, iteration_time: float) -> DecisionContext:
    return DecisionContext(
        step=step,
        session_steps=step,
        steps_since_checkpoint=step,
        elapsed=0.0,
        seconds_since_checkpoint=0.0,
        iteration_time=iteration_time,
        iteration_time_while_persisting=math.nan,
        stall=math.nan,
        persist_time=math.nan,
        bytes_per_checkpoint=0,
        persist_in_flight=False,
    )


def _rank(rank: int, store_path: str, out: str, script: dict[str, list]) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    policy = Scripted(script["yes_at"][rank], script["intervals"][rank])
    agreed = AgreedPolicy(policy, GroupPeers(dist.new_group(backend="gloo")), timeout=60)
    taken = [step for step in range(1, STEPS + 1) if agreed.should_save(_ctx(step, script["iteration"][rank]))]
    agreed.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"taken": taken, "asked": policy.asked}))
    dist.destroy_process_group()


def _run(
    tmp_path: Path, yes_at: list[list[int]], iteration: list[float], intervals: tuple[int, int] | list[int] = (0, 0)
) -> list[dict[str, list[int]]]:
    script = {"yes_at": yes_at, "iteration": iteration, "intervals": list(intervals)}
    spawn_ranks(_rank, (str(tmp_path / "store"), str(tmp_path), script), 2)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_the_ranks_exchange_every_quarter_second_and_a_one_step_wish_is_not_lost(tmp_path: Path) -> None:
    """10 ms iterations on both ranks propose an exchange every 25 steps: the ranks exchange at
    steps 1, 26, 51, ... Rank 1 wants a checkpoint at step 30 only; both ranks take it at 52, the
    step after the next exchange, and at no other step."""
    assert vote_steps(0.01) == math.ceil(VOTE_SECONDS / 0.01) == 25
    ranks = _run(tmp_path, [[], [30]], [0.01, 0.01])
    assert ranks[0]["taken"] == ranks[1]["taken"] == [52]
    assert 52 not in ranks[0]["asked"] and len(ranks[0]["asked"]) == STEPS - 1  # not asked at the step that checkpoints


def test_the_smallest_proposal_sets_the_next_exchange(tmp_path: Path) -> None:
    """Rank 0's 10 ms iterations propose every 25 steps, rank 1's 50 ms every 5: the ranks exchange
    at steps 1, 6, 11, ..., 31, so rank 0's wish at step 30 is taken at 32 on both."""
    ranks = _run(tmp_path, [[30], []], [0.01, 0.05])
    assert ranks[0]["taken"] == ranks[1]["taken"] == [32]


def test_an_exchange_comes_at_least_twice_per_planned_interval(tmp_path: Path) -> None:
    """Rank 1's policy plans every 8 steps: it proposes an exchange every 4 (not every 25), so
    rank 0's wish at step 30 is taken at 34 (exchanges at 1, 5, ..., 29, 33)."""
    ranks = _run(tmp_path, [[30], []], [0.01, 0.01], intervals=[0, 8])
    assert ranks[0]["taken"] == ranks[1]["taken"] == [34]


def test_until_the_iteration_time_is_measured_the_ranks_exchange_at_every_step(tmp_path: Path) -> None:
    ranks = _run(tmp_path, [[5, 40], []], [math.nan, math.nan])
    assert ranks[0]["taken"] == ranks[1]["taken"] == [6, 41]


@pytest.mark.parametrize(
    "iteration, interval, steps",
    [
        (math.nan, 0, 1),
        (0.0, 0, 1),
        (1.0, 0, 1),
        (1e-3, 0, 250),
        (1e-9, 0, MAX_VOTE_STEPS),
        (1e-3, 176, 88),
        (1e-3, 1000, 250),
        (1e-3, 1, 1),
        (math.nan, 100, 1),
    ],
)
def test_steps_between_exchanges(iteration: float, interval: int, steps: int) -> None:
    assert vote_steps(iteration, interval) == steps


class _Wires:
    """Ranks as threads of one process: a queue per (sender, receiver), every message counted."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.queues = {(a, b): queue.Queue() for a in range(size) for b in range(size) if a != b}
        self.sent = [0] * size
        self.received = [0] * size

    def peers(self, rank: int) -> _ThreadPeers:
        return _ThreadPeers(self, rank)


class _ThreadPeers:
    """One rank's side of :class:`_Wires`: only ``send`` and ``receive``, as the tree uses."""

    def __init__(self, wires: _Wires, rank: int) -> None:
        self.wires, self.rank, self.size = wires, rank, wires.size

    def send(self, payload: torch.Tensor, to: int) -> None:
        assert payload.dtype == torch.uint8 and payload.dim() == 1
        self.wires.sent[self.rank] += 1
        self.wires.queues[(self.rank, to)].put(payload.clone())

    def receive(self, size: int, sender: int) -> torch.Tensor:
        payload = self.wires.queues[(sender, self.rank)].get(timeout=30)
        assert payload.numel() == size
        self.wires.received[self.rank] += 1
        return payload


def _on_every_rank(size: int, work) -> list:
    with ThreadPoolExecutor(max_workers=size) as pool:
        return list(pool.map(work, range(size)))


@pytest.mark.parametrize("size", [1, 2, 7, 17, 100])
def test_the_tree_gives_every_rank_the_maximum_with_at_most_arity_plus_one_messages_each(size: int) -> None:
    """Each rank holds a different vector; every rank gets the elementwise maximum, and no rank
    sends or receives more than TREE_ARITY + 1 messages (rank 0 of 100 ranks: 8 in, 8 out)."""
    wires = _Wires(size)
    values = [torch.tensor([int(r == size // 2), -(r % 5) - 3, r * 7 % 11], dtype=torch.int64) for r in range(size)]
    expected = torch.stack(values).max(dim=0).values
    results = _on_every_rank(size, lambda r: tree_max(wires.peers(r), values[r]))
    assert all(torch.equal(result, expected) for result in results)
    assert max(wires.sent) <= TREE_ARITY + 1 and max(wires.received) <= TREE_ARITY + 1
    assert sum(wires.sent) == sum(wires.received) == 2 * (size - 1)  # one message up and one down per edge
    assert all(q.empty() for q in wires.queues.values())


def test_seventeen_ranks_voting_through_the_tree_checkpoint_at_the_same_steps() -> None:
    """Ranks as threads: rank 16 wants a checkpoint at step 30 only, rank 3 at step 70; 10 ms
    iterations give exchanges at steps 1, 26, 51, 76: every rank takes steps 52 and 77, no other."""
    wires = _Wires(17)

    def rank(r: int) -> list[int]:
        agreed = AgreedPolicy(Scripted({16: [30], 3: [70]}.get(r, []), 0), wires.peers(r), timeout=30)
        taken = [step for step in range(1, STEPS + 1) if agreed.should_save(_ctx(step, 0.01))]
        agreed.close()
        return taken

    assert _on_every_rank(17, rank) == [[52, 77]] * 17


def _failing_rank(rank: int, store_path: str, out: str, peer: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    agreed = AgreedPolicy(
        Scripted([], 0), GroupPeers(dist.new_group(backend="gloo", timeout=timedelta(seconds=2))), timeout=2
    )
    Path(out, f"ready{rank}").touch()
    for step in range(1, STEPS + 1):  # votes at every step: the iteration time is unknown
        if rank == 1 and step == 4:
            if peer == "dies":
                os._exit(0)
            time.sleep(30)  # alive, and silent
        try:
            agreed.should_save(_ctx(step, math.nan))
        except CheckfreqError as e:
            Path(out, "error.tmp").write_text(json.dumps({"step": step, "error": str(e)}))
            Path(out, "error.tmp").rename(Path(out, "error.json"))  # whole when the test sees it
            os._exit(0)


@pytest.mark.parametrize("peer", ["dies", "is silent"])
def test_a_vote_whose_peer_dies_or_is_silent_is_a_clear_error_on_the_training_thread(tmp_path: Path, peer: str) -> None:
    """Rank 1 stops voting after step 3 (it exits, or sleeps): rank 0's vote of step 4 fails, or
    brings nothing within the 2 s timeout, and its step 5 raises CheckfreqError (step 4 when rank 1
    exits before its vote thread has answered the vote of step 3)."""
    context = mp.spawn(_failing_rank, args=(str(tmp_path / "store"), str(tmp_path), peer), nprocs=2, join=False)
    _wait_for(lambda: all((tmp_path / f"ready{rank}").exists() for rank in (0, 1)), STARTUP_S)  # a busy machine
    _wait_for((tmp_path / "error.json").exists, 60)
    for process in context.processes:
        process.kill()
    failure = json.loads((tmp_path / "error.json").read_text())
    assert failure["step"] in (4, 5) and "rank 0: the ranks' vote on when to checkpoint" in failure["error"], failure


STARTUP_S = 600
"""How long two processes may take to import torch and meet, on a machine busy with other work."""


def _wait_for(condition: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)


def _frozen_rank(rank: int, store_path: str, out: str) -> None:
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    liveness = Liveness(dist.PrefixStore("alive", store), rank, 2, timeout=2.0)
    vote = GroupPeers(dist.new_group(backend="gloo", timeout=timedelta(minutes=5)), liveness, VOTE_ACTIVITY)
    agreed = AgreedPolicy(Scripted([], 0), vote, timeout=2.0, liveness=liveness)
    Path(out, f"ready{rank}").touch()
    for step in range(1, STEPS + 1):
        if rank == 1 and step == 4:
            os.kill(os.getpid(), signal.SIGSTOP)  # a node that vanished: its connections stay open, its heart stops
        try:
            agreed.should_save(_ctx(step, math.nan))
        except CheckfreqError as e:
            Path(out, "error.tmp").write_text(json.dumps({"step": step, "type": type(e).__name__, "error": str(e)}))
            Path(out, "error.tmp").rename(Path(out, "error.json"))
            time.sleep(60)  # a training thread stuck elsewhere: the process must end by itself


def test_a_vote_whose_peer_freezes_names_it_on_the_training_thread_and_the_process_ends_by_itself(
    tmp_path: Path,
) -> None:
    """Rank 1 stops (SIGSTOP) before its vote of step 4: rank 0's training thread, waiting for that
    vote's answer, names rank 1 as lost (not a rank that calls step() less often), and rank 0's
    process ends with status 1 a failure timeout later, although its training thread sleeps."""
    context = mp.spawn(_frozen_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=False)
    try:
        survivor = context.processes[0]
        _wait_for(lambda: all((tmp_path / f"ready{rank}").exists() for rank in (0, 1)), STARTUP_S)  # a busy machine
        survivor.join(timeout=90)
        assert survivor.exitcode == 1
    finally:
        for process in context.processes:
            process.kill()
    failure = json.loads((tmp_path / "error.json").read_text())
    assert failure["type"] == PeerLostError.__name__ and failure["step"] in (4, 5), failure
    assert "rank 1" in failure["error"] and f"stopped answering during {VOTE_ACTIVITY}" in failure["error"], failure


class _Silent(_ThreadPeers):
    """A rank whose parent never answers."""

    def receive(self, size: int, sender: int) -> torch.Tensor:
        time.sleep(5)
        raise AssertionError("not reached within the test")


class _Broken(_ThreadPeers):
    """A rank whose connection to its parent is gone."""

    def send(self, payload: torch.Tensor, to: int) -> None:
        raise RuntimeError("Connection reset by peer")


@pytest.mark.parametrize(
    "peers, error",
    [
        (_Silent, "brought no answer within 0.2 s"),
        (_Broken, r"failed \(RuntimeError: Connection reset by peer\); another rank may have died"),
    ],
)
def test_a_vote_that_fails_or_never_ends_is_a_clear_error_at_the_next_step_and_after(peers: type, error: str) -> None:
    agreed = AgreedPolicy(Scripted([], 0), peers(_Wires(2), 1), timeout=0.2)
    assert not agreed.should_save(_ctx(1, math.nan))  # starts the vote
    for step in (2, 3):
        with pytest.raises(CheckfreqError, match=error):
            agreed.should_save(_ctx(step, math.nan))
    agreed.close()  # the failure was raised already
