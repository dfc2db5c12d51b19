"""Where a checkpoint's score comes from (docs/storage.md, "Keeping the best"): ``ckpt.log()`` at its
step, ``step(loss=...)`` for the metric "loss", or a registered value as it is at the capture; a log decides
the step's checkpoint captures it at the step's consistent point, with whatever else the step did."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import checkfreq as cf
from checkfreq.run.events import read_events
from checkfreq.storage.local import LocalStore
from helpers import make_model, train_step


def _scores(directory: Path) -> dict[int, float | None]:
    store = LocalStore(directory, create=False)
    found = {}
    for step, location in store.checkpoints():
        score = store.read_manifest(location).score
        assert score is not None
        found[step] = score["value"]
    return found


def test_step_loss_scores_the_checkpoint_of_its_step(tmp_path: Path) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = {}
    keep = cf.Retention(1, best=("loss", "min"), top=2)
    with cf.Checkpointer(tmp_path, policy=2, keep=keep, model=model, optimizer=opt) as ckpt:
        for step in range(1, 11):
            losses[step] = train_step(model, opt)
            ckpt.step(loss=losses[step])
    checkpointed = {s: v for s, v in losses.items() if s % 2 == 0}
    best = sorted(checkpointed, key=lambda s: checkpointed[s])[:2]
    assert _scores(tmp_path) == {s: losses[s] for s in {*best, 10}}


def test_a_registered_value_scores_every_checkpoint_that_captures_it(tmp_path: Path) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    keep = cf.Retention(1, best=("smoothed", "max"), top=1)
    noisy = [0.1, 0.5, 0.3, 0.9, 0.2, 0.4]
    with cf.Checkpointer(
        tmp_path, policy=1, keep=keep, model=model, optimizer=opt, values={"smoothed": torch.tensor(0.0)}
    ) as ckpt:
        for value in noisy:
            train_step(model, opt)
            ckpt["smoothed"] = torch.tensor(value)  # a one-element tensor is a number
            ckpt.step()
    assert _scores(tmp_path) == {4: pytest.approx(0.9), 6: pytest.approx(0.4)}


def test_a_log_of_the_ranked_metric_is_captured_with_its_steps_checkpoint(tmp_path: Path) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    keep = cf.Retention(5, best=("val_loss", "min"))
    with cf.Checkpointer(tmp_path, policy=3, keep=keep, model=model, optimizer=opt) as ckpt:
        for step in range(1, 8):
            train_step(model, opt)  # its forward: the point of the step before
            ckpt.step()  # the policy's checkpoints at 3 and (3 steps after the one log() decided at 4) 7
            if step in (3, 4):
                ckpt.log(val_loss=1.0 / step, accuracy=0.5)  # at 3 the policy's checkpoint takes it; at 4 one decided
                ckpt.log(accuracy=0.6)  # not the retention's metric: nothing decided
        with pytest.raises(cf.errors.InvalidArgumentError, match="val_loss='low' is not a number"):
            ckpt.log(val_loss="low")
    assert _scores(tmp_path) == {3: pytest.approx(1 / 3), 4: 0.25, 7: None}
    snapshots = [e["step"] for e in read_events(tmp_path) if e["event"] == "snapshot"]
    assert snapshots == [3, 4, 7]  # each once


@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
def test_a_metric_that_is_not_finite_is_warned_once_and_never_the_best(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, value: float
) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    keep = cf.Retention(1, best=("val_loss", "min"), top=1)
    with (
        caplog.at_level(logging.WARNING, logger="checkfreq"),
        cf.Checkpointer(tmp_path, policy=100, keep=keep, model=model, optimizer=opt) as ckpt,
    ):
        for loss in [0.5, value, value, 0.7]:
            train_step(model, opt)
            ckpt.step()
            ckpt.log(val_loss=loss)
    assert sum("not a finite number" in r.getMessage() for r in caplog.records) == 1
    assert _scores(tmp_path) == {1: 0.5, 4: 0.7}  # the best (1) and the newest (4): neither non-finite one


def test_log_without_a_best_to_keep_takes_nothing(tmp_path: Path) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with cf.Checkpointer(tmp_path, policy=5, model=model, optimizer=opt) as ckpt:
        train_step(model, opt)
        ckpt.step()
        ckpt.log(val_loss=0.3)
    assert [e for e in read_events(tmp_path) if e["event"] == "snapshot"] == []
    with pytest.raises(cf.errors.UsageError, match="log"):
        ckpt.log(val_loss=0.3)


def test_a_memory_snapshot_at_the_epoch_boundary_does_not_stand_for_the_scored_checkpoint(tmp_path: Path) -> None:
    """With a memory tier snapshotting every step, the snapshot of an epoch's last step waits for the boundary,
    which ``log()`` is: it is taken after the log, yet the value still needs a checkpoint on disk."""
    from checkfreq.data import ResumableLoader

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randint(0, 3, (32,)))
    loader = ResumableLoader(data, batch_size=16, shuffle=True, seed=0)
    keep = cf.Retention(3, best=("val_loss", "min"))
    with cf.Checkpointer(tmp_path, policy=100, memory=1, keep=keep, model=model, optimizer=opt, loader=loader) as ckpt:
        for epoch in range(2):
            for x, y in loader:
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                ckpt.step()
            ckpt.log(val_loss=1.0 - epoch / 10)
    assert _scores(tmp_path) == {2: 1.0, 4: 0.9}
