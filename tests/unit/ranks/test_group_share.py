"""A machine's ranks keep one copy of the replicated state between them (checkfreq.ranks.group_share):
each keeps about 1/L of its bytes and its own private tensors, and the shares put together give
every rank its whole state back."""

from __future__ import annotations

import pytest
import torch
from fake_peers import FakePeers, run_ranks

from checkfreq.ranks import sharing
from checkfreq.ranks.group_share import Group, GroupSharer, groups_of, replica_ring
from checkfreq.ranks.rebuild import local_view
from checkfreq.storage.format import Manifest


def _state(rank: int) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Replicated tensors of uneven sizes (one much larger, to be split), and private ones per rank."""
    torch.manual_seed(0)
    tensors = {
        "model/big": torch.randn(300, 70),
        "model/small": torch.randn(5),
        "opt/state/0/exp_avg": torch.randn(300, 70),
        "opt/state/0/step": torch.tensor(7.0),
        "model/empty": torch.empty(0),
    }
    replicated = set(tensors)
    tensors["model/bn.running_mean"] = torch.full((4,), float(rank))
    tensors["values/running"] = torch.arange(3) + rank
    return tensors, replicated


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_the_shares_of_a_group_give_every_rank_its_whole_state(size: int) -> None:
    group = tuple(range(10, 10 + size))  # a machine's ranks need not start at 0
    shares = []
    for rank in group:
        tensors, replicated = _state(rank)
        arrays, fenced, index = GroupSharer(Group(group, rank, 20)).select(
            tensors, {"model/big"}, replicated, {"skeleton of": rank}
        )
        shares.append((rank, arrays, fenced, index))
    replicated_bytes = sum(t.numel() * t.element_size() for n, t in _state(0)[0].items() if n in _state(0)[1])
    everything: dict[str, torch.Tensor] = {}
    for _, arrays, _, _ in shares:
        assert not set(arrays) & set(everything)  # no two ranks store a name twice
        everything.update(arrays)
    for rank, arrays, fenced, index in shares:
        private = sum(t.numel() * t.element_size() for n, t in arrays.items() if "@rank" in n)
        assert sum(t.numel() * t.element_size() for t in arrays.values()) - private <= replicated_bytes / size * 1.1
        assert fenced == {name for name in arrays if name.startswith("model/big")}  # its pieces of the owned tensor
        assert index["group"] == list(group) and index["world_size"] == 20
        manifest = Manifest(
            step=3,
            epoch=0,
            world_size=1,
            files={},
            tensors={},
            state=None,
            versions={},
            created=0.0,
            distributed=dict(index),
        )
        skeleton, rebuilt = local_view(manifest, everything)
        expected, _ = _state(rank)
        assert skeleton == {"skeleton of": rank}
        assert rebuilt.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(rebuilt[name], tensor), name


def test_a_rank_belongs_to_its_group() -> None:
    with pytest.raises(ValueError, match="not in its group"):
        Group((0, 1), 2, 4)


def test_groups_are_the_ranks_with_one_key() -> None:
    assert groups_of(["a", "b", "a", "c", "b"]) == [[0, 2], [1, 4], [0, 2], [3], [1, 4]]


def test_ranks_learn_their_machine_in_a_few_messages() -> None:
    keys = ["m1", "m1", "m2", "m2", "m1", "m3"]

    def group(peers: FakePeers) -> list[int]:
        return sharing.memory_group(peers, keys[peers.rank]).ranks

    groups, wire = run_ranks(len(keys), group)
    assert groups == [[0, 1, 4], [0, 1, 4], [2, 3], [2, 3], [0, 1, 4], [5]]
    assert max(wire.received[rank] for rank in range(1, len(keys))) <= 2


def test_each_machine_copies_to_the_next_one_rank_to_rank() -> None:
    two = [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert replica_ring(two, 1) == [([2], [2]), ([3], [3]), ([0], [0]), ([1], [1])]
    three = [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5]]
    assert replica_ring(three, 1) == [([2], [4]), ([3], [5]), ([4], [0]), ([5], [1]), ([0], [2]), ([1], [3])]
    assert replica_ring(three, 1, stride=2) == [([4], [2]), ([5], [3]), ([0], [4]), ([1], [5]), ([2], [0]), ([3], [1])]
    uneven = [[0, 1, 2], [0, 1, 2], [0, 1, 2], [3], [4, 5], [4, 5]]
    assert replica_ring(uneven, 1) == [([3], [4]), ([3], [5]), ([3], []), ([4], [0, 1, 2]), ([0], [3]), ([1], [])]
    assert replica_ring(two[:2], 1) == [([], []), ([], [])]  # one machine: nowhere to copy to
    assert replica_ring(two, 1, stride=2) == [([], [])] * 4 and replica_ring(two, 0) == [([], [])] * 4


def test_k_copies_go_to_the_k_next_machines_stride_apart_and_no_further_than_the_ring() -> None:
    """``replicas=2``: each machine's ranks copy to the next two machines (``stride`` apart: another
    failure domain), each keeps the copies of the two machines before it; with fewer other machines
    than copies asked, each machine copies to every other one, once."""
    three = [[0], [1], [2]]
    assert replica_ring(three, 2) == [([1, 2], [1, 2]), ([2, 0], [0, 2]), ([0, 1], [0, 1])]
    assert replica_ring(three, 5) == replica_ring(three, 2)  # only two other machines
    assert replica_ring([[0], [1]], 2) == [([1], [1]), ([0], [0])]
    four = [[0], [1], [2], [3]]  # racks {0, 2} and {1, 3}: stride 1 keeps one copy in the other rack
    assert [to for to, _ in replica_ring(four, 1, stride=1)] == [[1], [2], [3], [0]]
    assert [to for to, _ in replica_ring(four, 3, stride=2)] == [[2], [3], [0], [1]]  # the ring of stride 2 is short
    six = [[r] for r in range(6)]
    assert [to for to, _ in replica_ring(six, 2, stride=3)] == [[3], [4], [5], [0], [1], [2]]
    assert [to for to, _ in replica_ring(six, 2, stride=2)] == [[2, 4], [3, 5], [4, 0], [5, 1], [0, 2], [1, 3]]
