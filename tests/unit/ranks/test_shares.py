"""How checkfreq.ranks.shares splits the replicated state over the ranks and finds the saved shards
a block needs: property tests of the promises in its docstrings."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkfreq.ranks.rebuild import chunk_holders, source_rank, uncovered
from checkfreq.ranks.shares import SHARDED, SMALL_FRACTION, Piece, cuts, partition, stream_range
from checkfreq.storage.format import Manifest

Sizes = list[tuple[str, int, int]]

NAMES = st.text(alphabet="abcdefgh./_0123456789", min_size=1, max_size=12)
SIZES = st.lists(
    st.tuples(
        NAMES, st.integers(0, 5000) | st.integers(0, 10) | st.integers(0, 2_000_000), st.sampled_from([1, 2, 4, 8])
    ),
    max_size=30,
    unique_by=lambda s: s[0],
)
WORLD = st.integers(1, 40)
PROPERTY = settings(max_examples=300, deadline=None)


def _coverage(plans: list[list[Piece]]) -> dict[str, list[tuple[int, int]]]:
    spans: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for pieces in plans:
        for piece in pieces:
            spans[piece.name].append((piece.begin, piece.end))
    return spans


@PROPERTY
@given(sizes=SIZES, world_size=WORLD)
def test_the_ranks_pieces_cover_every_element_of_every_tensor_exactly_once(sizes: Sizes, world_size: int) -> None:
    plans = partition(sizes, world_size)
    assert len(plans) == world_size
    spans = _coverage(plans)
    assert set(spans) == {name for name, _, _ in sizes}
    for name, numel, _ in sizes:
        covered = sorted(spans[name])
        if numel == 0:
            assert covered == [(0, 0)]
            continue
        assert all(begin < end for begin, end in covered)
        assert covered[0][0] == 0 and covered[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False)), covered  # no gap, no overlap
    stored = [piece.stored_name for pieces in plans for piece in pieces]
    assert len(stored) == len(set(stored))  # every piece has its own name in the data files
    for pieces in plans:
        for piece in pieces:
            numel = next(n for name, n, _ in sizes if name == piece.name)
            assert piece.whole == (piece.begin == 0 and piece.end == numel)


@PROPERTY
@given(sizes=SIZES, world_size=WORLD)
def test_each_rank_writes_its_share_within_the_documented_bound(sizes: Sizes, world_size: int) -> None:
    """Each rank's share differs from total / world_size by less than total / world_size /
    SMALL_FRACTION bytes plus one element and one byte (one tensor of 3 two-byte elements over 4
    ranks gives one rank 4 bytes: 2.5 from the ideal 1.5)."""
    itemsize = {name: size for name, _, size in sizes}
    total = sum(numel * size for _, numel, size in sizes)
    ideal = total / world_size
    element = max(itemsize.values(), default=1)
    for pieces in partition(sizes, world_size):
        load = sum((piece.end - piece.begin) * itemsize[piece.name] for piece in pieces)
        assert abs(load - ideal) < ideal / SMALL_FRACTION + element + 1, (load, ideal)


@PROPERTY
@given(sizes=SIZES, world_size=WORLD, seed=st.integers(0, 2**32))
def test_the_plan_does_not_depend_on_the_order_the_tensors_come_in(sizes: Sizes, world_size: int, seed: int) -> None:
    """Every rank computes the same plan from the same tensors, whatever order it lists them in."""
    shuffled = list(sizes)
    random.Random(seed).shuffle(shuffled)
    assert partition(shuffled, world_size) == partition(sizes, world_size)
    assert cuts(shuffled, world_size) == cuts(sizes, world_size)


@PROPERTY
@given(sizes=SIZES, world_size=WORLD)
def test_cuts_bound_the_ranks_ranges_of_the_stream(sizes: Sizes, world_size: int) -> None:
    bounds = cuts(sizes, world_size)
    total = sum(numel * size for _, numel, size in sizes)
    assert len(bounds) == world_size + 1 and bounds[0] == 0 and bounds[-1] == total
    assert bounds == sorted(bounds)
    nonempty = [s for s in sizes if s[1] > 0]
    for rank, pieces in enumerate(partition(sizes, world_size)):
        assert [p for p in pieces if p.end > p.begin] == stream_range(nonempty, bounds[rank], bounds[rank + 1])


@PROPERTY
@given(sizes=SIZES, data=st.data())
def test_stream_range_cuts_at_element_boundaries(sizes: Sizes, data: st.DataObject) -> None:
    """Any range of the stream, even cut inside an element: the element straddling its end belongs to the next."""
    total = sum(numel * size for _, numel, size in sizes)
    points = sorted(data.draw(st.lists(st.integers(0, total), max_size=6)) + [0, total])
    spans = _coverage([stream_range(sizes, lo, hi) for lo, hi in zip(points, points[1:], strict=False)])
    for name, numel, _ in sizes:
        if numel:
            covered = sorted(s for s in spans[name] if s[0] < s[1])
            assert covered[0][0] == 0 and covered[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))


def test_a_small_tensor_is_never_split() -> None:
    sizes = [("a", 1000, 4), ("b", 10, 4), ("c", 1002, 4)]  # b straddles the middle of the stream, nearer its end
    plans = partition(sizes, 2)
    assert _coverage(plans)["b"] == [(0, 10)]
    assert [(p.name, p.whole) for p in plans[0]] == [("a", True), ("b", True)]


def test_a_large_tensor_is_split_and_empty_ones_go_to_rank_0() -> None:
    plans = partition([("big", 1000, 4), ("empty", 0, 4)], 4)
    assert [[(p.stored_name, p.begin, p.end) for p in pieces] for pieces in plans] == [
        [("empty", 0, 0), ("big@0-250", 0, 250)],
        [("big@250-500", 250, 500)],
        [("big@500-750", 500, 750)],
        [("big@750-1000", 750, 1000)],
    ]


@settings(max_examples=300, deadline=None)
@given(length=st.integers(0, 60), parts=st.integers(1, 12), data=st.data())
def test_chunk_holders_are_the_torch_chunk_blocks_the_box_meets(length: int, parts: int, data: st.DataObject) -> None:
    begin = data.draw(st.integers(0, length))
    size = data.draw(st.integers(0, length - begin))
    other = data.draw(st.integers(0, 3))
    blocks = torch.arange(length).chunk(parts) if length else ()
    meets = [begin < int(block[-1]) + 1 and int(block[0]) < begin + size for block in blocks]
    expected = [k for k, met in enumerate(meets) if met and size and other]  # an empty box needs no block
    assert list(chunk_holders((3, length), 1, parts, ((0, begin), (other, size)))) == expected


@given(rank=st.integers(0, 1000), saved=st.integers(1, 100))
def test_source_rank(rank: int, saved: int) -> None:
    source = source_rank(rank, saved)
    assert 0 <= source < saved
    assert source == rank if rank < saved else source == source_rank(rank - saved, saved)


def _sharded_manifest(shards: dict[str, tuple[list[int], list[int]]]) -> Manifest:
    """A manifest whose sharded tensor ``w`` (4 x 3) is saved as ``shards``: stored name → (offset, shape)."""
    return Manifest(
        step=1,
        epoch=None,
        world_size=2,
        files={},
        tensors={
            name: {"file": "f", "dtype": "F32", "shape": shape, "offsets": [0, 0]}  # type: ignore[misc]
            for name, (_, shape) in shards.items()
        },
        state=None,
        versions={},
        created=0.0,
        distributed={
            "ranks": [{}, {}],
            "tensors": {
                "w": {
                    "kind": SHARDED,
                    "dtype": "F32",
                    "shape": [4, 3],
                    "parts": [[name, offset] for name, (offset, _) in shards.items()],
                },
            },
        },
    )


@pytest.mark.parametrize(
    ("shards", "block", "short"),
    [
        ({"w@rank00000": ([0, 0], [2, 3]), "w@rank00001": ([2, 0], [2, 3])}, ((0, 0), (4, 3)), []),
        ({"w@rank00000": ([0, 0], [2, 3])}, ((0, 0), (4, 3)), ["w"]),
        ({"w@rank00000": ([0, 0], [2, 3])}, ((0, 0), (2, 3)), []),
        ({"w@rank00000": ([0, 0], [2, 3])}, ((1, 1), (1, 2)), []),
        ({"w@rank00001": ([2, 0], [2, 3])}, ((1, 0), (2, 3)), ["w"]),
        ({"w@rank00000": ([0, 0], [4, 2])}, ((0, 0), (4, 3)), ["w"]),
    ],
)
def test_uncovered_names_the_blocks_the_saved_shards_do_not_cover(
    shards: dict[str, tuple[list[int], list[int]]], block: tuple[tuple[int, ...], tuple[int, ...]], short: list[str]
) -> None:
    assert uncovered(_sharded_manifest(shards), {"w": block}) == short
