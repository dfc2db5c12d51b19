"""Rank 0's choice of the memory snapshot to restore and of the copies the ranks that lost theirs
take over (:func:`memory_choice`, :func:`fetch_plan`): the newest snapshot every rank can have, of
one step *and* one course; a step of another course is another state, never mixed in."""

from __future__ import annotations

from checkfreq.pipeline.restore.messages import FetchPlan, MemoryChoice, MemoryReport
from checkfreq.pipeline.restore.plan import fetch_plan, memory_choice
from checkfreq.pipeline.tiers.roles import SnapshotKey

NOW, LEFT = 17, 5
"""The course the run is on, and one it left (the steps after a restore to an older one)."""


def held(*steps: int, course: int = NOW) -> list[SnapshotKey]:
    return [(step, course) for step in steps]


def test_a_rank_that_lost_its_snapshots_takes_the_newest_step_all_can_have_from_a_copy() -> None:
    kept = {2: held(6, 5), 3: held(5)}  # node 0's ranks keep node 1's copies; rank 3's newest did not arrive
    survivors = [MemoryReport(held(6, 5), 4, {2: kept[2]}), MemoryReport(held(6, 5), 4, {3: kept[3]})]
    replaced = [MemoryReport([], None), MemoryReport([], None)]  # a new node: empty memory and disk
    assert fetch_plan(survivors + replaced) == FetchPlan(5, [(2, 0), (3, 1)], course=NOW)
    kept[3].insert(0, (6, NOW))
    assert fetch_plan(survivors + replaced) == FetchPlan(6, [(2, 0), (3, 1)], course=NOW)
    assert fetch_plan([MemoryReport(held(6), 4), MemoryReport(held(6), 4)]) == FetchPlan(None, [])  # nothing lost
    assert fetch_plan(survivors + [MemoryReport([], 8), replaced[1]]) == FetchPlan(None, [])  # disk is newer
    no_copies = [MemoryReport(held(6, 5), 4), MemoryReport(held(6, 5), 4)]
    assert fetch_plan(no_copies + replaced) == FetchPlan(None, [])  # replicas=0: nothing kept of ranks 2 and 3


def test_a_rank_whose_copy_several_ranks_keep_is_given_every_keeper_in_turn() -> None:
    """``replicas=2`` on three machines of one rank, machine 2 replaced: both others keep rank 2's copy
    of step 6 and are its keepers in rank order (the second tried if the first fails); rank 1 kept no
    copy of step 6, so it is not among them."""
    survivors = [
        MemoryReport(held(6, 4), None, {1: held(6, 4), 2: held(6, 4)}),
        MemoryReport(held(6, 4), None, {0: held(6), 2: held(6, 4)}),
    ]
    assert fetch_plan([*survivors, MemoryReport([], None)]) == FetchPlan(6, [(2, 0), (2, 1)], course=NOW)
    survivors[1].copies[2] = held(4)  # rank 1's copy of step 6 did not arrive
    assert fetch_plan([*survivors, MemoryReport([], None)]) == FetchPlan(6, [(2, 0)], course=NOW)
    lost_two = [MemoryReport(held(6, 4), None, {1: held(6, 4), 2: held(6)}), MemoryReport([], None)]
    assert fetch_plan([*lost_two, MemoryReport([], None)]) == FetchPlan(6, [(1, 0), (2, 0)], course=NOW)


def test_a_copy_found_damaged_is_passed_over_for_another_keeper_else_an_older_step() -> None:
    """A copy no keeper could give (rank, step, keeper) is left out of the next plan: the other
    machine's copy of that step if there is one, else the newest older step every rank can have,
    else nothing (the restore reads disk)."""
    survivors = [MemoryReport(held(6, 5), 4, {2: held(6, 5)}), MemoryReport(held(6, 5), 4, {3: held(6, 5)})]
    replaced = [MemoryReport([], None), MemoryReport([], None)]
    assert fetch_plan(survivors + replaced, frozenset({(2, 6, 0)})) == FetchPlan(5, [(2, 0), (3, 1)], course=NOW)
    twice = [MemoryReport(held(6, 5), 4, {2: held(6, 5)}), MemoryReport(held(6, 5), 4, {2: held(6), 3: held(6, 5)})]
    assert fetch_plan(twice + replaced) == FetchPlan(6, [(2, 0), (2, 1), (3, 1)], course=NOW)  # both keepers
    unusable = frozenset({(2, 6, 0)})
    assert fetch_plan(twice + replaced, unusable) == FetchPlan(6, [(2, 1), (3, 1)], course=NOW)  # its other copy
    assert fetch_plan(survivors + replaced, frozenset({(2, 6, 0), (2, 5, 0)})) == FetchPlan(None, [])  # disk then


def test_a_node_absent_from_a_restore_brings_back_no_snapshot_of_the_course_the_run_left() -> None:
    """Node 1 (ranks 2 and 3) was away while the run restored step 4 and went on: it still holds its
    snapshots 6 and 8 of the course left, and node 0 holds 6 and 8 again, of the course the run is on.
    The same step numbers are other states: no snapshot is common, memory gives way to disk."""
    again = [MemoryReport(held(8, 6), 4), MemoryReport(held(8, 6), 4)]
    absent = [MemoryReport(held(8, 6, course=LEFT), 4), MemoryReport(held(8, 6, course=LEFT), 4)]
    assert memory_choice(again + absent) == MemoryChoice(None, False)
    assert memory_choice(again + again) == MemoryChoice((8, NOW), True)
    mixed = [MemoryReport(held(8) + held(6, course=LEFT), 4)] * 2 + [MemoryReport(held(6, course=LEFT), 4)] * 2
    assert memory_choice(mixed) == MemoryChoice((6, LEFT), True)  # a step every rank holds of one course


def test_a_copy_of_the_course_the_run_left_is_never_taken_over() -> None:
    """Node 1 replaced after the restore to step 4: node 0 keeps copies of node 1's ranks at steps 8
    and 6, but those of step 8 are of the course the run left (kept before the restore), and node 0's
    own step 8 is of the course it is on. Only step 6, of one course on every rank, is taken over."""
    copies = {2: held(8, course=LEFT) + held(6), 3: held(8, course=LEFT) + held(6)}
    survivors = [MemoryReport(held(8, 6), 4, {2: copies[2]}), MemoryReport(held(8, 6), 4, {3: copies[3]})]
    replaced = [MemoryReport([], None), MemoryReport([], None)]
    assert fetch_plan(survivors + replaced) == FetchPlan(6, [(2, 0), (3, 1)], course=NOW)
    copies[2][1] = (6, LEFT)  # rank 2's copy of step 6 is of the course left too: no step every rank can have
    assert fetch_plan(survivors + replaced) == FetchPlan(None, [])
