"""Agreeing on when to checkpoint: two real gloo ranks, policies with plain scripted answers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from checkfreq.agreement import MAX_VOTE_STEPS, VOTE_SECONDS, AgreedPolicy, vote_steps
from checkfreq.policies import DecisionContext

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
    return DecisionContext(step=step, session_steps=step, steps_since_checkpoint=step, elapsed=0.0,
                           seconds_since_checkpoint=0.0, iteration_time=iteration_time,
                           iteration_time_while_persisting=math.nan, stall=math.nan, persist_time=math.nan,
                           bytes_per_checkpoint=0, persist_in_flight=False)


def _rank(rank: int, store_path: str, out: str, script: dict[str, list]) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    policy = Scripted(script["yes_at"][rank], script["intervals"][rank])
    agreed = AgreedPolicy(policy, dist.new_group(backend="gloo"))
    taken = [step for step in range(1, STEPS + 1) if agreed.should_save(_ctx(step, script["iteration"][rank]))]
    agreed.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"taken": taken, "asked": policy.asked}))
    dist.destroy_process_group()


def _run(tmp_path: Path, yes_at: list[list[int]], iteration: list[float],
         intervals: tuple[int, int] | list[int] = (0, 0)) -> list[dict[str, list[int]]]:
    script = {"yes_at": yes_at, "iteration": iteration, "intervals": list(intervals)}
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path), script), nprocs=2, join=True)
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


@pytest.mark.parametrize("iteration, interval, steps", [
    (math.nan, 0, 1), (0.0, 0, 1), (1.0, 0, 1), (1e-3, 0, 250), (1e-9, 0, MAX_VOTE_STEPS),
    (1e-3, 176, 88), (1e-3, 1000, 250), (1e-3, 1, 1), (math.nan, 100, 1),
])
def test_steps_between_exchanges(iteration: float, interval: int, steps: int) -> None:
    assert vote_steps(iteration, interval) == steps
