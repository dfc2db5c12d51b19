"""ResumableSampler and ResumableLoader: pure order, exactly once, O(1) resume, reproducible augmentation."""

from __future__ import annotations

import json
import random
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from checkfreq.data import ResumableLoader, ResumableSampler, sample_seed
from checkfreq.errors import TopologyError


class Augmented:
    """Each sample is its index plus one draw from each of Python's, NumPy's and torch's generators."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[int, float, float, float]:
        return index, random.random(), float(np.random.rand()), torch.rand(()).item()


class Counting:
    """Counts ``__getitem__`` calls (in the main process)."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.calls = 0

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        self.calls += 1
        return index


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(3))


def collate_rows(rows: list[tuple]) -> list[tuple]:
    """Keep samples as plain tuples so values compare exactly."""
    return rows


def loader(length: int = 23, **kwargs) -> ResumableLoader:
    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("shuffle", True)
    kwargs.setdefault("seed", 7)
    return ResumableLoader(Augmented(length), collate_fn=collate_rows, **kwargs)


def take(it, batches: int) -> list[tuple]:
    return [row for _ in range(batches) for row in next(it)]


def one_epoch(source: ResumableLoader) -> list[tuple]:
    return [row for batch in source for row in batch]


def indices(rows: list[tuple]) -> list[int]:
    return [row[0] for row in rows]


# ---------------------------------------------------------------- order


def test_order_is_a_pure_function_of_seed_and_epoch():
    a, b = ResumableSampler(100, seed=3), ResumableSampler(100, seed=3)
    for _ in range(3):
        a.global_order(5)  # asking changes nothing
    assert torch.equal(a.global_order(5), b.global_order(5))
    assert sorted(a.global_order(5).tolist()) == list(range(100))
    assert not torch.equal(a.global_order(5), a.global_order(6))
    assert not torch.equal(a.global_order(5), ResumableSampler(100, seed=4).global_order(5))
    assert ResumableSampler(10, shuffle=False).global_order(3).tolist() == list(range(10))


def test_order_does_not_depend_on_global_rng():
    torch.manual_seed(1)
    first = ResumableSampler(50, seed=0).global_order(2)
    torch.manual_seed(2)
    assert torch.equal(first, ResumableSampler(50, seed=0).global_order(2))


def test_sample_seed_differs_by_seed_epoch_and_index():
    seeds = {sample_seed(s, e, i) for s in range(3) for e in range(3) for i in range(50)}
    assert len(seeds) == 3 * 3 * 50
    assert all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterating_leaves_the_callers_generators_alone(num_workers):
    source = loader(num_workers=num_workers)
    torch.manual_seed(11), random.seed(11), np.random.seed(11)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(11), random.seed(11), np.random.seed(11)
    one_epoch(source)
    assert torch.equal(torch.rand(3), expected[0])
    assert random.random() == expected[1]
    assert np.random.rand() == expected[2]


# ---------------------------------------------------------------- ranks


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_partition_an_epoch_exactly_once(world_size):
    shares = [ResumableSampler(24, seed=1, rank=r, world_size=world_size).rank_indices() for r in range(world_size)]
    assert sorted(i for share in shares for i in share) == list(range(24))
    assert len({len(share) for share in shares}) == 1


@pytest.mark.parametrize("drop_last", [False, True])
def test_uneven_split_keeps_ranks_equal_like_distributed_sampler(drop_last):
    shares = [ResumableSampler(10, seed=1, rank=r, world_size=4, drop_last=drop_last).rank_indices() for r in range(4)]
    assert {len(share) for share in shares} == ({2} if drop_last else {3})
    seen = Counter(i for share in shares for i in share)
    if drop_last:
        assert max(seen.values()) == 1 and len(seen) == 8
    else:
        assert set(seen) == set(range(10)) and sum(seen.values()) == 12


def test_rank_and_world_size_are_validated():
    with pytest.raises(ValueError, match="rank"):
        ResumableSampler(10, rank=2, world_size=2)
    with pytest.raises(ValueError, match="length"):
        ResumableSampler(-1)


# ---------------------------------------------------------------- resume


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("stop_after", [1, 3, 5])
def test_resume_mid_epoch_continues_with_the_next_sample(drop_last, stop_after):
    expected = one_epoch(loader(drop_last=drop_last))
    first = loader(drop_last=drop_last)
    head = take(iter(first), stop_after)
    state = json.loads(json.dumps(first.state_dict()))  # JSON-able, and survives the round trip
    at_end = stop_after == len(first)  # 5 batches with drop_last: the epoch's last
    assert (state["epoch"], state["consumed"]) == ((1, 0) if at_end else (0, 4 * stop_after))

    second = loader(drop_last=drop_last)
    second.load_state_dict(state)
    assert head + ([] if at_end else one_epoch(second)) == expected
    assert second.epoch == 1


def test_resume_at_the_epoch_boundary():
    uninterrupted = loader()
    expected = [one_epoch(uninterrupted) for _ in range(2)]

    first = loader()
    it = iter(first)
    head = take(it, len(first))  # every batch taken, the loop has not asked for the next one
    assert first.epoch == 0
    state = first.state_dict()  # a checkpoint after the last batch: the start of the next epoch
    assert (state["epoch"], state["consumed"], first.epoch) == (1, 0, 1)
    second = loader()
    second.load_state_dict(state)
    assert second.epoch == 1
    assert [head, one_epoch(second)] == expected

    with pytest.raises(StopIteration):
        next(it)  # the loop asks: the epoch has already moved on, and moves no further
    assert first.state_dict()["epoch"] == 1 and first.state_dict()["consumed"] == 0


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_state_saved_after_an_epochs_last_batch_is_the_next_epochs_start(drop_last):
    """As earlier versions saved it ("epoch 0, every sample taken"), and, with ``drop_last``, where the
    samples left make no whole batch (20 of 23 taken in batches of 4)."""
    expected = _epoch(1, drop_last=drop_last)
    restored = loader(drop_last=drop_last)
    restored.load_state_dict({**restored.state_dict(), "consumed": 20 if drop_last else 23})
    assert restored.epoch == 1 and restored.state_dict()["consumed"] == 0
    assert one_epoch(restored) == expected


def _epoch(epoch: int, **kwargs) -> list[tuple]:
    fresh = loader(**kwargs)
    fresh.set_epoch(epoch)
    return one_epoch(fresh)


@pytest.mark.parametrize("defaulted", [False, True])
def test_a_peek_after_an_epoch_boundary_restore_costs_nothing(defaulted):
    """The DDP tutorial's epoch: ``next(iter(loader))`` for the batch size, ``set_epoch(epoch)``, the loop."""
    first = loader()
    for _ in first:
        pass
    take(iter(first), len(first))  # the second epoch, up to its last batch
    state = first.state_dict()  # a checkpoint right after it, before the loop asks for more
    restored = loader()
    restored.load_state_dict(state)
    start = restored.epoch
    assert start == 2
    peeked = next(iter(restored), None) if defaulted else next(iter(restored))
    assert peeked == _epoch(2)[:4]
    assert (restored.epoch, restored.sampler.consumed) == (2, 0)  # the peek moved nothing
    restored.sampler.set_epoch(start)  # the epoch it is in: changes nothing
    restored.set_epoch(start)
    assert restored.state_dict() == state  # nor did the peek count (a checkpoint now would not count it)
    assert one_epoch(restored) == _epoch(2)


def test_moving_back_to_an_epoch_already_trained_is_logged(caplog):
    source = loader()
    one_epoch(source)
    with caplog.at_level("WARNING", logger="checkfreq.data"):
        source.set_epoch(1)
        assert not caplog.records
        source.set_epoch(0)
    assert "back from epoch 1 to the start of epoch 0" in caplog.text
    assert source.state_dict()["consumed"] == 0 and source.epoch == 0


def test_prefetched_batches_are_not_counted_as_consumed():
    source = loader(num_workers=2, prefetch_factor=4)
    it = iter(source)
    next(it)
    assert source.state_dict()["consumed"] == 4


def run_epochs(make, epochs: int, interrupt_after: list[int]) -> list[list[tuple]]:
    """The canonical loop, restarted from a fresh loader after the given global batch counts."""
    log: list[list[tuple]] = [[] for _ in range(epochs)]
    state, done, stops = None, 0, sorted(interrupt_after)
    while True:
        source = make()
        if state is not None:
            source.load_state_dict(state)
        stopped = False
        for epoch in range(source.epoch, epochs):
            for batch in source:
                log[epoch].extend(batch)
                done += 1
                if stops and done == stops[0]:
                    stops.pop(0)
                    state, stopped = source.state_dict(), True
                    break
            if stopped:
                break
        if not stopped:
            return log


@settings(max_examples=25, deadline=None)
@given(
    drop_last=st.booleans(),
    stops=st.lists(st.integers(min_value=1, max_value=17), max_size=3, unique=True),
)
def test_the_epoch_loop_continues_correctly_after_any_restore(drop_last, stops):
    make = lambda: loader(drop_last=drop_last)  # noqa: E731
    expected = run_epochs(make, 3, [])
    assert run_epochs(make, 3, stops) == expected
    for epoch in expected:
        assert len(set(indices(epoch))) == len(epoch) == (20 if drop_last else 23)


def test_set_epoch_keeps_the_position_of_the_current_epoch():
    source = loader()
    it = iter(source)
    take(it, 2)
    assert source.state_dict()["consumed"] == 8  # a checkpoint counts the batch it trained on
    take(it, 1)
    source.set_epoch(0)  # the batch handed out since is given again, as by a new iterator
    assert source.state_dict()["consumed"] == 8
    source.set_epoch(4)
    assert source.epoch == 4 and source.state_dict()["consumed"] == 0


def test_the_last_batch_of_an_epoch_that_is_over_is_not_counted_in_the_next():
    source = loader()
    it = iter(source)
    take(it, len(source))  # every batch trained on, the loop has not asked for the next one
    source.sampler.set_epoch(1)  # as Lightning calls it at the top of each epoch
    assert source.state_dict()["epoch"] == 1 and source.state_dict()["consumed"] == 0
    fresh = loader()
    fresh.set_epoch(1)
    assert indices(one_epoch(source)) == indices(one_epoch(fresh))  # the whole of epoch 1


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ({"num_workers": 0, "batch_size": 4}, {"num_workers": 2, "batch_size": 4}),
        ({"num_workers": 2, "batch_size": 4}, {"num_workers": 0, "batch_size": 3}),
        ({"num_workers": 0, "batch_size": 4}, {"num_workers": 2, "batch_size": 5}),
    ],
)
def test_resume_with_other_workers_or_batch_size_yields_the_rest_once(before, after):
    expected = one_epoch(loader())
    first = loader(**before)
    head = take(iter(first), 3)
    second = loader(**after)
    second.load_state_dict(first.state_dict())
    assert head + one_epoch(second) == expected  # same samples, order and augmentations


def test_augmentations_reproduce_whatever_the_workers():
    serial = one_epoch(loader(num_workers=0))
    parallel_loader = loader(num_workers=2, persistent_workers=True)
    parallel = one_epoch(parallel_loader)
    assert parallel == serial
    next_epoch = one_epoch(parallel_loader)
    by_index = {row[0]: row for row in serial}
    assert all(row[1:] != by_index[row[0]][1:] for row in next_epoch)  # fresh draws each epoch


def test_resume_cost_does_not_depend_on_the_position():
    """Resuming in the middle of a 1,000,000-sample epoch reads only the samples it yields."""
    costs = []
    for consumed in (0, 500_000, 999_999):
        dataset = Counting(1_000_000)
        source = ResumableLoader(dataset, batch_size=8, shuffle=True)
        state = source.state_dict() | {"consumed": consumed}
        source.load_state_dict(state)
        next(iter(source))
        costs.append(dataset.calls)
    assert costs == [8, 8, 1]


# ---------------------------------------------------------------- world size


def lockstep(loaders: list[ResumableLoader], batches: int) -> list[int]:
    iterators = [iter(source) for source in loaders]
    return [i for _ in range(batches) for it in iterators for i in indices(next(it))]


def rest_of_epoch(loaders: list[ResumableLoader]) -> list[int]:
    return [i for source in loaders for i in indices(one_epoch(source))]


def test_world_size_two_to_one_keeps_exactly_once():
    ranks = [loader(24, rank=r, world_size=2) for r in range(2)]
    head = lockstep(ranks, 2)
    assert ranks[0].state_dict() == ranks[1].state_dict()
    single = loader(24, world_size=1)
    single.load_state_dict(ranks[0].state_dict())
    seen = head + rest_of_epoch([single])
    assert sorted(seen) == list(range(24))
    assert seen[16:] == ResumableSampler(24, seed=7).global_order(0)[16:].tolist()


@pytest.mark.parametrize(("length", "repeats"), [(24, 0), (25, 1)])
def test_world_size_one_to_two_keeps_exactly_once(length, repeats):
    single = loader(length, world_size=1)
    head = indices(take(iter(single), 3))
    ranks = [loader(length, rank=r, world_size=2) for r in range(2)]
    for source in ranks:
        source.load_state_dict(single.state_dict())
    seen = Counter(head + rest_of_epoch(ranks))
    assert set(seen) == set(range(length))
    assert sum(seen.values()) == length + repeats  # an odd remainder repeats one, as DistributedSampler


# ---------------------------------------------------------------- errors


def test_state_for_another_dataset_is_refused_clearly():
    state = loader(23).state_dict()
    with pytest.raises(ValueError, match="dataset_length=23 but this loader has dataset_length=24"):
        loader(24).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        loader(seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle"):
        loader(shuffle=False).load_state_dict(state)


def test_malformed_state_is_refused_clearly():
    source = loader()
    with pytest.raises(ValueError, match="lacks \\['consumed'\\]"):
        source.load_state_dict({k: v for k, v in source.state_dict().items() if k != "consumed"})
    with pytest.raises(ValueError, match="consumed=24"):
        source.load_state_dict(source.state_dict() | {"consumed": 24})


def test_state_may_come_back_as_tensors():
    first = loader()
    take(iter(first), 2)
    state = {k: torch.tensor(v) if isinstance(v, int) else v for k, v in first.state_dict().items()}
    second = loader()
    second.load_state_dict(state)
    assert second.state_dict() == first.state_dict()


@pytest.mark.parametrize("persistent_workers", [False, True])
def test_a_stale_iterator_raises_and_takes_nothing(persistent_workers):
    expected = one_epoch(loader())
    source = loader(num_workers=2, persistent_workers=persistent_workers)
    stale = iter(source)
    head = take(stale, 2)[:4]  # its second batch was handed out but never used: the next iterator gives it again
    current = iter(source)
    head += take(current, 1)
    with pytest.raises(RuntimeError, match="stale"):
        next(stale)
    assert head + [row for batch in current for row in batch] == expected


def test_loader_arguments_are_checked():
    with pytest.raises(TypeError, match="sets \\['sampler'\\] itself"):
        loader(sampler=None)
    with pytest.raises(ValueError, match="batch_size"):
        loader(batch_size=0)
    with pytest.raises(TypeError, match="map-style"):
        ResumableLoader(Stream())


def test_len_counts_batches_of_a_whole_epoch():
    assert len(loader(23)) == 6
    assert len(loader(23, drop_last=True)) == 5
    assert len(loader(23, rank=1, world_size=2)) == 3


def test_peeking_at_a_batch_loses_no_sample():
    """``next(iter(loader))`` to read a batch's shape, as DDP tutorials do, then the epoch's loop."""
    expected = one_epoch(loader())
    source = loader()
    peeked = take(iter(source), 1)
    source.sampler.set_epoch(0)
    assert peeked == expected[:4]
    assert one_epoch(source) == expected
    assert source.epoch == 1


# ---------------------------------------------------------------- global batches


def ranks_of(world_size: int, length: int = 30, **kwargs) -> list[ResumableLoader]:
    kwargs.setdefault("global_batch_size", 12)
    return [loader(length, batch_size=None, rank=r, world_size=world_size, **kwargs) for r in range(world_size)]


def global_steps(ranks: list[ResumableLoader], steps: int | None = None) -> list[list[int]]:
    """The sample ids of each optimizer step (every rank's micro-batches of it), in lockstep."""
    iterators, per_step = [iter(source) for source in ranks], ranks[0].accumulation_steps
    taken: list[list[int]] = []
    while steps is None or len(taken) < steps:
        try:
            taken.append([i for it in iterators for _ in range(per_step) for i in indices(next(it))])
        except StopIteration:
            break
    return taken


@pytest.mark.parametrize("drop_last", [False, True])
def test_global_batches_do_not_depend_on_world_size_or_micro_batches(drop_last):
    expected = global_steps(ranks_of(1, drop_last=drop_last))
    order = ResumableSampler(30, seed=7).global_order(0).tolist()
    if drop_last:  # 30 samples: two steps of 12, the tail of 6 left out
        assert expected == [order[:12], order[12:24]]
    else:  # the tail completed with the epoch's first samples
        assert expected == [order[:12], order[12:24], order[24:] + order[:6]]
    for world_size, cap in [(2, None), (3, None), (4, None), (6, None), (2, 4), (1, 5), (3, 1)]:
        ranks = ranks_of(world_size, drop_last=drop_last, micro_batch_size=cap)
        steps = global_steps(ranks)
        assert [sorted(s) for s in steps] == [sorted(s) for s in expected], (world_size, cap)
        share = 12 // world_size
        assert ranks[0].batch_size * ranks[0].accumulation_steps == share
        assert ranks[0].batch_size <= (cap or share)
        assert len(ranks[0]) == len(expected) * ranks[0].accumulation_steps


def test_resuming_on_fewer_then_more_ranks_keeps_every_step():
    """4 ranks -> 2 ranks with micro-batches -> 4 ranks: the steps of an uninterrupted run at 4, exactly."""
    expected = [sorted(s) for s in global_steps(ranks_of(4, length=72))]
    four = ranks_of(4, length=72)
    seen = global_steps(four, 2)
    two = ranks_of(2, length=72, micro_batch_size=2)
    assert two[0].accumulation_steps == 3
    for source in two:
        source.load_state_dict(four[0].state_dict())
    seen += global_steps(two, 1)
    again = ranks_of(4, length=72)
    for source in again:
        source.load_state_dict(two[1].state_dict())
    assert again[0].state_dict()["consumed"] == 36
    seen += global_steps(again)
    assert [sorted(s) for s in seen] == expected
    assert sorted(i for s in seen for i in s) == list(range(72))


def test_a_checkpoint_between_micro_batches_is_refused():
    two = ranks_of(2, micro_batch_size=2)  # 6 samples per rank and step: 3 micro-batches
    it = iter(two[0])
    first = indices(next(it))
    next(it)
    with pytest.raises(RuntimeError, match="after 2 of the 3 micro-batches of an optimizer step"):
        two[0].state_dict()
    assert indices(next(iter(two[0]))) == first  # a new pass replays the unfinished step


def test_world_size_must_divide_the_global_batch():
    five = loader(30, batch_size=None, global_batch_size=12, rank=0, world_size=5)
    with pytest.raises(TopologyError, match="global_batch_size=12 does not split over 5 ranks"):
        iter(five).__next__()
    with pytest.raises(TopologyError, match="does not split"):
        _ = five.accumulation_steps


def test_global_batch_state_is_checked_against_the_loader():
    single = ranks_of(1)[0]
    global_steps([single], 1)
    state = single.state_dict()
    assert state["global_batch_size"] == 12 and state["consumed"] == 12
    with pytest.raises(ValueError, match="saved with global_batch_size=12 but this loader has global_batch_size=None"):
        loader(30).load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch_size=12 but this loader has global_batch_size=6"):
        ranks_of(1, global_batch_size=6)[0].load_state_dict(state)
    with pytest.raises(ValueError, match="inside a global batch of 12"):
        ranks_of(1)[0].load_state_dict(state | {"consumed": 5})
    # a state without global_batch_size (per-rank batches, or an earlier version): at a step boundary only
    per_rank = loader(30, batch_size=4)
    take(iter(per_rank), 3)
    resumed = ranks_of(1)[0]
    resumed.load_state_dict(per_rank.state_dict())
    assert global_steps([resumed], 1) == [ResumableSampler(30, seed=7).global_order(0)[12:24].tolist()]
    take(iter(per_rank), 1)
    with pytest.raises(ValueError, match="not a boundary of global batches of 12"):
        ranks_of(1)[0].load_state_dict(per_rank.state_dict())


def test_global_batch_arguments_are_checked():
    with pytest.raises(TypeError, match="batch_size \\(per rank\\) or global_batch_size"):
        loader(batch_size=4, global_batch_size=8)
    with pytest.raises(TypeError, match="pass global_batch_size too"):
        loader(micro_batch_size=4)
    with pytest.raises(ValueError, match="global_batch_size must be a positive int"):
        loader(batch_size=None, global_batch_size=0)
    assert loader(batch_size=3, world_size=2, rank=0).global_batch_size == 6
