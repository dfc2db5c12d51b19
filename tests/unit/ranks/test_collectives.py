"""The message logic of checkfreq.ranks.collectives over an in-process world (fake_peers.py) and a world of one."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fake_peers import FakePeers, run_ranks

from checkfreq.ranks.collectives import (
    TREE_ARITY,
    Solo,
    collect_errors,
    receive_json,
    scatter_json,
    send_json,
    tree_max,
)

MESSAGES = [
    None,
    0,
    -(2**63),
    2**70,
    1.5,
    "",
    "snowman ☃ and 𝄞",
    [],
    {},
    [1, [2, [3, None]]],
    {"a": {"b": [True, False]}, "rank": 3, "é": "ü"},
    "x" * 100_000,
]


@pytest.mark.parametrize("value", MESSAGES, ids=range(len(MESSAGES)))
def test_send_json_reaches_receive_json_unchanged(value: Any) -> None:
    def exchange(peers: FakePeers) -> Any:
        if peers.rank == 0:
            send_json(peers, value, 1)
            return receive_json(peers, 1)
        got = receive_json(peers, 0)
        send_json(peers, got, 0)
        return got

    (back, got), _ = run_ranks(2, exchange)
    assert got == value and back == value


def test_json_messages_keep_their_order_between_two_ranks() -> None:
    def exchange(peers: FakePeers) -> list[Any]:
        if peers.rank == 0:
            for value in MESSAGES:
                send_json(peers, value, 1)
            return []
        return [receive_json(peers, 0) for _ in MESSAGES]

    (_, got), _ = run_ranks(2, exchange)
    assert got == MESSAGES


def test_tuples_arrive_as_lists() -> None:
    """Messages are JSON: what a rank gets is what JSON keeps, the same on every rank, Solo included."""
    (_, got), _ = run_ranks(2, lambda p: send_json(p, (1, (2,)), 1) if p.rank == 0 else receive_json(p, 0))
    assert got == [1, [2]]
    solo = Solo()
    assert solo.all_gather((1, (2,))) == [[1, [2]]] and solo.broadcast((1,)) == [1] and solo.gather((1,)) == [[1]]


def test_solo_collectives_copy_and_refuse_point_to_point() -> None:
    solo = Solo()
    value = {"a": [1, 2]}
    gathered = solo.all_gather(value)
    gathered[0]["a"].append(3)
    assert value == {"a": [1, 2]}  # a copy, as the bytes another rank would receive
    assert solo.broadcast(value) is not value and solo.broadcast(value) == value
    row = torch.arange(5, dtype=torch.uint8)
    assert torch.equal(solo.all_gather_rows(row), row.reshape(1, 5))
    with pytest.raises(RuntimeError):
        solo.send(row, 0)
    with pytest.raises(RuntimeError):
        solo.receive(5, 0)
    with pytest.raises(TypeError):
        solo.all_gather({1, 2})  # not JSON-able: refused as on a real group, not passed through


def test_solo_collect_errors_scatter_and_tree_max() -> None:
    solo = Solo()
    assert collect_errors(solo, None) == []
    assert collect_errors(solo, "disk full") == ["disk full"]
    assert scatter_json(solo, [{"leader": 0}]) == {"leader": 0}
    assert torch.equal(tree_max(solo, torch.tensor([3, -1])), torch.tensor([3, -1]))


@pytest.mark.parametrize("size", [2, 5])
def test_collect_errors_is_every_ranks_errors_in_rank_order_on_every_rank(size: int) -> None:
    failing = {1: "rank 1: disk full", size - 1: f"rank {size - 1}: no space"}
    results, _ = run_ranks(size, lambda p: collect_errors(p, failing.get(p.rank)))
    assert results == [[failing[r] for r in sorted(failing)]] * size
    results, _ = run_ranks(size, lambda p: collect_errors(p, None))
    assert results == [[]] * size


@pytest.mark.parametrize("size", [1, 2, 7])
def test_scatter_json_gives_each_rank_its_own_value_in_one_message(size: int) -> None:
    values = [{"rank": r, "name": f"r{r}", "list": list(range(r))} for r in range(size)]
    results, wire = run_ranks(size, lambda p: scatter_json(p, values if p.rank == 0 else None))
    assert results == values
    for rank in range(1, size):  # one JSON message: its length, then its bytes
        assert wire.received[rank] == 2 and wire.sent[rank] == 0


@pytest.mark.parametrize("size", [1, 2, 8, 9, 10, 73, 74])
def test_tree_max_is_the_elementwise_maximum_on_every_rank(size: int) -> None:
    """73 ranks fill two levels of the tree below rank 0 (1 + 8 + 64); 74 needs a third."""

    def value(rank: int) -> torch.Tensor:
        return torch.tensor([rank, -rank, (rank * 37) % 11, 2**40 + (rank == size // 2)], dtype=torch.int64)

    results, wire = run_ranks(size, lambda p: tree_max(p, value(p.rank)))
    expected = torch.stack([value(r) for r in range(size)]).max(dim=0).values
    for result in results:
        assert result.dtype == torch.int64 and torch.equal(result, expected)
    # the documented bound: a rank receives at most TREE_ARITY + 1 messages and sends as many
    assert max(wire.received.values(), default=0) <= TREE_ARITY + 1
    assert max(wire.sent.values(), default=0) <= TREE_ARITY + 1
    assert sum(wire.sent.values()) == 2 * (size - 1)  # up and down each edge of the tree once


def test_tree_max_takes_any_integer_vector_shape() -> None:
    results, _ = run_ranks(3, lambda p: tree_max(p, torch.full((2, 2), p.rank, dtype=torch.int32)))
    for result in results:
        assert torch.equal(result, torch.full((4,), 2, dtype=torch.int64))
