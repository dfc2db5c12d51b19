"""Retention as a pure policy: which steps go, with plain numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import checkfreq as cf
from checkfreq.pipeline.retention.retainer import Retainer
from checkfreq.policies.retention import Retention
from checkfreq.storage.base import write_data, write_manifest
from checkfreq.storage.format import FileEntry, Manifest, encode_header, plan_layout, tensor_entries
from checkfreq.storage.local import LocalStore

DATA = "rank00000.safetensors"


def _commit(store: LocalStore, step: int) -> None:
    """A real one-tensor checkpoint at ``step`` (retention reads back those that hold a slot)."""
    staging = store.staging_dir(step, "job")
    layout = plan_layout({"w": (torch.float32, (4,))})
    size, digest = write_data(store, staging, DATA, encode_header(layout), torch.zeros(16, dtype=torch.uint8))
    files = {DATA: FileEntry(size=size, xxh3_64=digest)}
    tensors = tensor_entries(layout, DATA)
    manifest = Manifest(
        step=step, epoch=None, world_size=1, files=files, tensors=tensors, state=None, versions={}, created=0.0
    )
    write_manifest(store, staging, manifest)
    store.commit(staging, step)


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


def test_damaged_checkpoints_expire_once_keep_valid_ones_are_newer() -> None:
    assert Retention(keep=3).expired([4, 2], [6]) == []  # fewer than keep valid: it may be all there is
    assert Retention(keep=3).expired([10, 7, 4], [6]) == []  # 2 valid ones newer
    assert Retention(keep=3).expired([13, 10, 7], [6, 1, 13]) == [1, 6]
    assert Retention(keep=1, every=2).expired([8, 6, 4], [5, 6]) == [5, 6]  # a damaged milestone is none


def test_retention_counts_only_the_listed_valid_checkpoints(tmp_path: Path) -> None:
    """A damaged checkpoint set aside holds no slot: ``keep=3`` keeps three valid ones, and never deletes
    a valid one in its favour; it goes once three valid ones are newer."""
    store = LocalStore(tmp_path)
    retainer = Retainer(store, Retention(keep=3), leader=True)
    for step in (2, 4, 6):
        _commit(store, step)
    store.set_aside(store.location(6), "data file rank00000.safetensors is truncated")
    for step in (7, 10):
        _commit(store, step)
        retainer.run(protect=step)
    assert [s for s, _ in store.checkpoints()] == [10, 7, 4]
    assert [(a.step, a.reason) for a in store.set_aside_checkpoints()] == [
        (6, "data file rank00000.safetensors is truncated")
    ]
    Retainer(store, Retention(keep=3), leader=False).run()  # only the leader deletes
    _commit(store, 13)
    retainer.run(protect=13)
    assert [s for s, _ in store.checkpoints()] == [13, 10, 7] and store.set_aside_checkpoints() == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000007", "step_000000010", "step_000000013"]


@pytest.mark.parametrize("bad", [{"keep": 0}, {"keep": 1.5}, {"keep": True}, {"keep": 2, "every": 0}])
def test_refuses_meaningless_counts(bad: dict) -> None:
    with pytest.raises(cf.InvalidArgumentError):
        Retention(**bad)


def test_a_directorys_leader_applies_a_retention(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    for step in (100, 150, 200, 250, 300):
        _commit(store, step)
    Retainer(store, Retention(keep=1, every=100), leader=False).run(protect=150)
    assert len(store.checkpoints()) == 5  # only a directory's leader deletes
    Retainer(store, Retention(keep=1, every=100), leader=True).run(protect=150)
    assert [step for step, _ in store.checkpoints()] == [300, 200, 150, 100]
    assert not list(tmp_path.glob("step_*.tmp-*"))  # deleted, not left hidden


def test_checkpointer_keeps_milestones_locally_and_remotely(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    remote = tmp_path / "remote"
    with cf.Checkpointer(
        tmp_path / "local",
        remote=remote,
        policy=1,
        keep=Retention(2, every=5),
        remote_keep=Retention(1, every=4),
        model=model,
        optimizer=opt,
    ) as ckpt:
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


def test_keeps_the_top_scoring_by_the_metric_beside_the_newest() -> None:
    """``best``: the ``top`` best scores are kept however old; a step without a score is never among them."""
    steps = [10, 20, 30, 40, 50, 60]
    scores = {10: 0.5, 20: 0.2, 30: None, 40: 0.9, 50: 0.3}  # 60: none logged
    low = Retention(2, best=("val_loss", "min"), top=2)
    assert low.best_steps(steps, scores) == [20, 50]
    assert low.doomed(steps, scores=scores) == [10, 30, 40]
    high = Retention(1, best=("accuracy", "max"), top=1)
    assert high.doomed(steps, scores=scores) == [10, 20, 30, 50]
    assert low.doomed(steps) == [10, 20, 30, 40]  # no scores read: the newest only
    assert Retention(1, every=30, best=("val_loss", "min")).doomed(steps, scores=scores) == [10, 40, 50]


def test_a_newer_checkpoint_must_score_strictly_better_to_displace_a_best() -> None:
    rule = Retention(1, best=("val_loss", "min"), top=1)
    assert rule.best_steps([1, 2, 3], {1: 0.4, 2: 0.4, 3: 0.4}) == [1]
    assert rule.best_steps([1, 2, 3], {1: 0.4, 2: float("nan"), 3: 0.39}) == [3]
    assert rule.best_steps([1, 2], {1: float("nan"), 2: None}) == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"best": ("val_loss", "lowest")}, "best must be (metric name, 'min' or 'max')"),
        ({"best": "val_loss"}, "best must be"),
        ({"best": ("", "min")}, "best must be"),
        ({"top": 2}, "top=2 needs best="),
        ({"best": ("val_loss", "min"), "top": 0}, "top must be an int >= 1"),
    ],
)
def test_best_is_checked(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(cf.errors.InvalidArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Retention(3, **kwargs)  # type: ignore[arg-type]
    assert Retention(3, best=["val_loss", "max"]).best == ("val_loss", "max")  # type: ignore[arg-type]


def test_the_holders_of_a_slot_are_the_newest_and_the_best() -> None:
    assert Retention(keep=2).holders([10, 20, 30, 40]) == [40, 30]
    assert Retention(keep=1, every=10).holders([10, 20, 25]) == [25]  # a milestone holds no slot
    assert Retention(2, best=("loss", "min")).holders([1, 2, 3, 4], {1: 0.1, 4: 0.5}) == [4, 3, 1]
