"""Retention as a pure policy: which steps go, with plain numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import checkfreq as cf
from checkfreq.pipeline.retainer import Retainer
from checkfreq.policies.retention import Retention
from checkfreq.storage.local import LocalStore


def test_keeps_the_newest() -> None:
    assert Retention(keep=2).doomed([10, 20, 30, 40]) == [10, 20]
    assert Retention(keep=2).doomed([40, 10, 30, 20, 30]) == [10, 20]  # any order, duplicates once
    assert Retention(keep=5).doomed([1, 2, 3]) == []
    assert Retention(keep=1).doomed([]) == []


def test_keeps_every_multiple_of_every() -> None:
    steps = range(100, 1100, 100)  # 100 ... 1000
    assert Retention(keep=2, every=300).doomed(steps) == [100, 200, 400, 500, 700, 800]
    assert Retention(keep=1, every=1000).doomed([999, 1000, 1001, 2000, 2001]) == [999, 1001]


def test_never_dooms_a_protected_step_nor_the_newest() -> None:
    assert Retention(keep=1).doomed([1, 2, 3, 4], protect=[2]) == [1, 3]
    assert Retention(keep=1).doomed([1, 2, 3], protect=[3, 7]) == [1, 2]  # a protected step may be absent
    for steps in ([5], [1, 9, 3], list(range(50))):
        for keep in (1, 2, 10):
            doomed = Retention(keep=keep, every=7).doomed(steps, protect=[steps[0]])
            assert max(steps) not in doomed and steps[0] not in doomed
            assert set(doomed) <= set(steps)


@pytest.mark.parametrize("bad", [{"keep": 0}, {"keep": 1.5}, {"keep": True}, {"keep": 2, "every": 0}])
def test_refuses_meaningless_counts(bad: dict) -> None:
    with pytest.raises(cf.InvalidArgumentError):
        Retention(**bad)


def test_a_directorys_leader_applies_a_retention(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    for step in (100, 150, 200, 250, 300):
        store.commit(store.staging_dir(step, "job"), step)
    Retainer(store, Retention(keep=1, every=100), leader=False).run(protect=150)
    assert len(store.checkpoints()) == 5  # only a directory's leader deletes
    Retainer(store, Retention(keep=1, every=100), leader=True).run(protect=150)
    assert [step for step, _ in store.checkpoints()] == [300, 200, 150, 100]
    assert not list(tmp_path.glob("step_*.tmp-*"))  # deleted, not left hidden


def test_checkpointer_keeps_milestones_locally_and_remotely(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    remote = tmp_path / "remote"
    with cf.Checkpointer(tmp_path / "local", remote=remote, policy=1, keep=Retention(2, every=5),
                         remote_keep=Retention(1, every=4), model=model, optimizer=opt) as ckpt:
        for _ in range(12):
            model(torch.ones(1, 4)).sum().backward()
            opt.step()
            ckpt.step()
            ckpt.wait(remote=True)
    assert [s for s, _ in LocalStore(tmp_path / "local").checkpoints()] == [12, 11, 10, 5]
    assert [s for s, _ in LocalStore(remote).checkpoints()] == [12, 8, 4]


def test_keep_takes_a_count_or_a_retention(tmp_path: Path) -> None:
    with pytest.raises(cf.ArgumentTypeError, match="int .* or a checkfreq.Retention"):
        cf.Checkpointer(tmp_path, keep="3", model=torch.nn.Linear(1, 1))
