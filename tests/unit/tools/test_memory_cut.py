"""Where the ranks listed on a machine would resume from memory, and the copy lag `checkfreq ls` says."""

from __future__ import annotations

from checkfreq.cli.inspect_cmds import _memory_cut_text
from checkfreq.tools.catalog import CheckpointStatus
from checkfreq.tools.memory_cut import memory_cut


def _held(kind: str, rank: int, step: int, created: float | None = None, valid: bool = True) -> CheckpointStatus:
    name = f"memory {'rank' if kind == 'own' else 'copy of rank'} {rank} slot {step % 3}"
    return CheckpointStatus(
        name, "/dev/shm/x", step, None, 100, created, valid, None if valid else "torn", True, tier="memory"
    )


def _disk(step: int) -> CheckpointStatus:
    return CheckpointStatus(f"step_{step:09d}", "/run", step, 0, 100, 0.0, True, None, True)


def test_the_newest_step_every_listed_rank_holds_and_how_far_it_lags() -> None:
    statuses = [
        *(_held("own", rank, step, created=float(step)) for rank in (0, 1) for step in (73, 75, 77)),
        *(_held("copy", rank, step) for rank in (2, 3) for step in (73, 75)),
        _held("copy", 3, 77, valid=False),  # a copy torn on the way counts for nothing
        _disk(80),  # nor does a checkpoint on disk
    ]
    cut = memory_cut(statuses)
    assert cut is not None
    assert (cut.own_ranks, cut.copied_ranks, cut.newest_step, cut.resume_step) == ([0, 1], [2, 3], 77, 75)
    assert cut.lag_steps == 2 and cut.lag_s == 2.0
    text = _memory_cut_text(cut)
    assert "keeps copies of rank 2, 3: if their machine were lost now, every rank would resume from memory" in text
    assert "at step 75, 2 steps, 2 s behind this machine's newest snapshot (77): the copy lag" in text


def test_no_step_held_by_every_rank_says_a_lost_machine_resumes_from_disk() -> None:
    """What the machine held in the failure that made copies keep a consistent cut: its own 75 and
    77, a copy of rank 3 at 73 only."""
    statuses = [*(_held("own", 0, step) for step in (75, 77)), _held("copy", 3, 73)]
    cut = memory_cut(statuses)
    assert cut is not None and cut.resume_step is None and cut.lag_steps is None
    assert "no step is held whole by every rank listed here" in _memory_cut_text(cut)
    assert "resume from disk" in _memory_cut_text(cut)


def test_a_machine_that_keeps_no_copy_says_nothing() -> None:
    assert memory_cut([_held("own", 0, 5), _disk(5)]) is None
    assert memory_cut([_held("copy", 2, 5)]) is None  # no snapshot of its own to lag behind
