"""Going on from an older checkpoint (``restore(step=N)``, ``restore("best")``, then training): the
newer checkpoints are of a course the run left. They are set aside at the first step, in the directory
and in the remote tier, so that a later ``restore()`` takes the new course's newest and never the
course left; ``restore(step=)`` of one says why it is not restored, and retention deletes them in
time. The memory tier drops its later snapshots, and the copies it keeps of them, at the restore."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import checkfreq as cf
from checkfreq.storage.base import Aside
from checkfreq.storage.local import LocalStore
from checkfreq.storage.remote import FsspecStore
from checkfreq.storage.shm import MemoryRegion
from checkfreq.storage.shm_paths import device_and_inode, replica_path
from helpers import assert_state_equal, make_model, train_step


def _train(
    directory: Path,
    steps: int,
    *,
    lr: float = 0.1,
    restore: int | str | None = None,
    losses: dict[int, float] | None = None,
    **options: Any,
) -> tuple[int, dict[str, Any]]:
    """Restore (the newest, or ``restore``), train ``steps`` steps with ``lr`` checkpointing every 2;
    the step restored and the model's state at the end."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    options.setdefault("keep", 3)
    with cf.Checkpointer(directory, model=model, optimizer=optimizer, policy=cf.Every(2), **options) as ckpt:
        restored = ckpt.restore() if restore is None else ckpt.restore(restore)
        for _ in range(steps):
            train_step(model, optimizer)
            ckpt.step()
            if losses is not None:
                ckpt.log(val_loss=losses[ckpt.global_step])
            if "remote" in options:
                ckpt.wait(remote=True)
    return restored, {k: v.clone() for k, v in model.state_dict().items()}


def _abandoned(store: LocalStore | FsspecStore) -> list[int]:
    return [a.step for a in store.set_aside_checkpoints() if a.kind is Aside.ABANDONED]


def test_a_later_restore_takes_the_new_course_not_the_one_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    _train(run, 10)  # keeps 6, 8, 10
    with caplog.at_level(logging.WARNING, logger="checkfreq"):
        restored, went_on = _train(run, 2, lr=0.5, restore=6)  # a new course: step 8 again, with another lr
    assert restored == 6
    assert "going on from step 6" in caplog.text and "steps 8, 10" in caplog.text
    store = LocalStore(run, create=False)
    assert [step for step, _ in store.checkpoints()] == [8, 6]
    assert _abandoned(store) == [10, 8]
    restored, state = _train(run, 0)
    assert restored == 8
    assert_state_equal(state, went_on)


def test_the_first_step_after_the_restore_is_where_the_course_turns(tmp_path: Path) -> None:
    """A restore of 6 only to look at it (no training after it) leaves 8 and 10 where they are; one
    step of training after it sets them aside, and the next ``restore()`` resumes from 6."""
    run = tmp_path / "run"
    _train(run, 10)
    _train(run, 0, restore=6)
    assert _train(run, 0)[0] == 10
    _, at_six = _train(run, 0, restore=6)
    _train(run, 1, restore=6)  # step 7: not checkpointed (every 2)
    restored, state = _train(run, 0)
    assert restored == 6
    assert_state_equal(state, at_six)


def test_a_checkpoint_of_the_course_left_is_refused_by_name_and_comes_back_by_a_rename(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _, at_ten = _train(run, 10)
    _train(run, 1, restore=6)
    with pytest.raises(cf.errors.NoValidCheckpointError, match="course the run left.*went on from step 6") as info:
        _train(run, 0, restore=10)
    (aside,) = run.glob("step_000000010.abandoned-*")
    assert aside.name in str(info.value)
    aside.rename(run / "step_000000010")
    restored, state = _train(run, 0, restore=10)
    assert restored == 10
    assert_state_equal(state, at_ten)


def test_retention_deletes_the_course_left_once_keep_newer_checkpoints_exist(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(run, 10)
    _train(run, 10, restore=6)  # checkpoints 8 to 16 of the new course
    store = LocalStore(run, create=False)
    assert [step for step, _ in store.checkpoints()] == [16, 14, 12]
    assert store.set_aside_checkpoints() == []


def test_going_back_to_the_best_sets_aside_the_newer_ones(tmp_path: Path) -> None:
    run = tmp_path / "run"
    losses = {1: 5.0, 2: 4.0, 3: 3.0, 4: 1.0, 5: 2.0, 6: 2.5, 7: 3.0, 8: 3.5, 9: 4.0, 10: 4.5}
    keep = cf.Retention(3, best=("val_loss", "min"))
    _train(run, 10, keep=keep, losses=losses)
    restored, went_on = _train(run, 1, keep=keep, restore="best", lr=0.5, losses=losses)
    assert restored == 4
    assert _abandoned(LocalStore(run, create=False)) == [10, 9, 8]  # log() checkpoints every step
    restored, state = _train(run, 0, keep=keep)
    assert restored == 5  # the new course's step 5, not the step 10 of the course left
    assert_state_equal(state, went_on)


def test_the_remote_tier_sets_aside_the_course_left_too(tmp_path: Path) -> None:
    remote = f"memory://checkfreq-test-{uuid.uuid4().hex[:12]}/run"
    _train(tmp_path / "run", 10, remote=remote, remote_keep=3)
    _train(tmp_path / "run", 1, restore=6, remote=remote, remote_keep=3)  # step 7: not checkpointed
    store = FsspecStore(remote, create=False)
    assert [step for step, _ in store.checkpoints()] == [6]
    assert _abandoned(store) == [10, 8]
    restored, _ = _train(tmp_path / "elsewhere", 0, remote=remote)  # a new machine: only the remote tier
    assert restored == 6


def _plant_copy(directory: Path, sender: int, step: int) -> None:
    """A copy of rank ``sender``'s memory snapshot ``step`` kept on this machine (``replicas=``)."""
    region = MemoryRegion(replica_path(directory, sender), device_and_inode(directory))
    region.reserve(64, 64)
    region.commit(region.begin(), step, 64, b"{}", b"")
    region.release(remove=False)


def _copies(directory: Path, sender: int) -> list[int]:
    region = MemoryRegion(replica_path(directory, sender), device_and_inode(directory), tidy=False)
    try:
        return [info.step for info in region.snapshots()]
    finally:
        region.release(remove=False)


def test_the_memory_tier_drops_the_copies_it_keeps_of_the_course_left(shm_dir: Path, tmp_path: Path) -> None:
    """A copy kept here of another rank's snapshot newer than the step the run goes on from would let a
    later restore put the course left together from copies; it is dropped, an older one stays."""
    run = tmp_path / "run"
    _train(run, 10, memory=1)
    _plant_copy(run, 1, 10)
    _plant_copy(run, 2, 4)
    _train(run, 0, restore=6, memory=1)
    assert _copies(run, 1) == [] and _copies(run, 2) == [4]
