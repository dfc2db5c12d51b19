"""The checkpoint due at an epoch's last batch waits for the epoch boundary; save() holds the state
at the moment it is called; work done after ckpt.step() that no checkpoint holds is named once."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import checkfreq as cf
from checkfreq.data import ResumableLoader
from checkfreq.run.events import read_events

BATCHES = 4


class Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return BATCHES * 2

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((4,), float(i)), i % 2


def _objects(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler,
                                     ResumableLoader]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), ResumableLoader(Points(), batch_size=2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _snapshots(directory: Path) -> list[int]:
    return [e["step"] for e in read_events(directory) if e["event"] == "snapshot"]


def test_the_checkpoint_due_at_an_epochs_last_batch_is_taken_at_the_next_pass(tmp_path: Path) -> None:
    model, opt, sched, loader = _objects()
    with cf.Checkpointer(tmp_path, policy=BATCHES, model=model, optimizer=opt, scheduler=sched, loader=loader) as ckpt:
        for x, y in loader:
            _train(model, opt, x, y)
            assert ckpt.step() == (ckpt.global_step == BATCHES)  # due, and said so
        assert _snapshots(tmp_path) == []  # not taken yet: the epoch's work comes first
        sched.step()
        next(iter(loader))  # a peek: the boundary
        assert _snapshots(tmp_path) == [BATCHES]
        ckpt.wait()
    fresh_model, fresh_opt, fresh_sched, fresh_loader = _objects(seed=1)
    with cf.Checkpointer(tmp_path, model=fresh_model, optimizer=fresh_opt, scheduler=fresh_sched,
                         loader=fresh_loader) as again:
        assert again.restore() == BATCHES
    assert fresh_sched.get_last_lr() == sched.get_last_lr() == [0.05]  # the epoch's scheduler step is in it
    assert fresh_loader.state_dict()["epoch"] == 1 and fresh_loader.state_dict()["consumed"] == 0
    listed = [e for e in read_events(tmp_path) if e["event"] == "snapshot"]
    assert listed[0]["epoch"] == 1  # the label agrees with the loader's state


def test_a_step_before_any_boundary_takes_the_deferred_checkpoint_at_its_own_step(tmp_path: Path) -> None:
    """A loop that never iterates the loader again after an epoch's last batch."""
    model, opt, sched, loader = _objects()
    with cf.Checkpointer(tmp_path, policy=100, model=model, optimizer=opt, loader=loader) as ckpt:
        batches = list(loader)  # the whole epoch taken at once: the pass is over, nothing is deferred
        for x, y in batches[:-1]:
            _train(model, opt, x, y)
            ckpt.step()
        it = iter(loader)
        for _ in range(BATCHES):  # the epoch once more, ending on its last batch
            x, y = next(it)
        _train(model, opt, x, y)
        assert loader.last_of_epoch
        ckpt.save()  # save() is a boundary as well
        assert _snapshots(tmp_path) == [ckpt.global_step]
    # a policy checkpoint deferred, then a step() with no boundary in between: taken at the new step
    model, opt, _, loader = _objects()
    with cf.Checkpointer(tmp_path / "b", policy=BATCHES, model=model, optimizer=opt, loader=loader) as ckpt:
        it = iter(loader)
        for _ in range(BATCHES):
            x, y = next(it)
            _train(model, opt, x, y)
            ckpt.step()
        assert _snapshots(tmp_path / "b") == []
        assert next(it, None) is None  # the pass is over, and the loop never asks for another
        _train(model, opt, x, y)
        ckpt.step()
        assert _snapshots(tmp_path / "b") == [BATCHES + 1]


def test_save_takes_the_step_again_when_registered_state_changed_since(tmp_path: Path) -> None:
    model, opt, sched, loader = _objects()
    with cf.Checkpointer(tmp_path, policy=2, model=model, optimizer=opt, scheduler=sched, loader=loader,
                         values={"best": 0.0}) as ckpt:
        it = iter(loader)
        for _ in range(2):
            _train(model, opt, *next(it))
            ckpt.step()
        ckpt.save(blocking=True)  # nothing changed since the policy's checkpoint at 2: none taken
        assert _snapshots(tmp_path) == [2]
        sched.step()
        ckpt.save(blocking=True)
        assert _snapshots(tmp_path) == [2, 2]
        ckpt["best"] = 3.5
        ckpt.save()
        with torch.no_grad():
            model.weight.add_(1.0)  # parameters changed in place, no optimizer step
        ckpt.save(blocking=True)
        assert _snapshots(tmp_path) == [2, 2, 2, 2]
        ended = {k: v.clone() for k, v in model.state_dict().items()}
    assert [p.name for p in tmp_path.glob("step_*")] == ["step_000000002"]
    model2, opt2, sched2, loader2 = _objects(seed=1)
    with cf.Checkpointer(tmp_path, model=model2, optimizer=opt2, scheduler=sched2, loader=loader2,
                         values={"best": 0.0}) as again:
        assert again.restore() == 2 and again["best"] == 3.5
    assert sched2.get_last_lr() == [0.05]
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in ended.items())


def test_save_with_a_remote_tier_copies_the_step_taken_again(tmp_path: Path) -> None:
    model, opt, sched, loader = _objects()
    with cf.Checkpointer(tmp_path / "local", remote=tmp_path / "remote", policy=2, model=model, optimizer=opt,
                         scheduler=sched, loader=loader) as ckpt:
        it = iter(loader)
        for _ in range(2):
            _train(model, opt, *next(it))
            ckpt.step()
        ckpt.wait(remote=True)
        sched.step()
        ckpt.save(blocking=True)
    model2, opt2, sched2, loader2 = _objects(seed=1)
    with cf.Checkpointer(tmp_path / "remote", model=model2, optimizer=opt2, scheduler=sched2, loader=loader2) as again:
        assert again.restore() == 2
    assert sched2.get_last_lr() == [0.05]


@pytest.mark.parametrize("change", ["scheduler", "best", "rng"])
def test_state_changed_between_a_checkpoint_and_the_next_batch_is_named_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, change: str) -> None:
    model, opt, sched, loader = _objects()
    with caplog.at_level(logging.WARNING, logger="checkfreq"), \
            cf.Checkpointer(tmp_path, policy=1, model=model, optimizer=opt, scheduler=sched, loader=loader,
                            values={"best": 0.0}) as ckpt:
        for epoch in range(2):
            for x, y in loader:
                _train(model, opt, x, y)
                ckpt.step()
                if change == "scheduler":
                    sched.step()  # per iteration, after ckpt.step()
                elif change == "best":
                    ckpt["best"] = float(epoch + ckpt.global_step)
                else:
                    torch.rand(1)  # random numbers drawn for other work after the checkpoint
    warnings = [r.getMessage() for r in caplog.records if "changed after the checkpoint" in r.getMessage()]
    named = {"scheduler": "'scheduler'", "best": "'best'", "rng": "the random generators (rng)"}[change]
    assert len(warnings) == 1 and named in warnings[0] and "at step 1 " in warnings[0], warnings


def test_the_loop_with_its_work_before_ckpt_step_and_after_the_epoch_warns_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt, sched, loader = _objects()
    with caplog.at_level(logging.WARNING, logger="checkfreq"), \
            cf.Checkpointer(tmp_path, policy=3, model=model, optimizer=opt, scheduler=sched, loader=loader,
                            values={"best": 0.0}) as ckpt:
        for _ in range(3):
            for x, y in loader:
                _train(model, opt, x, y)
                ckpt["best"] = float(ckpt.global_step)  # set before the step
                ckpt.step()
            torch.rand(3)  # an evaluation's draws, after the epoch's batches
            sched.step()
        ckpt.save(blocking=True)
    assert _snapshots(tmp_path) == [3, 6, 9, 12]  # mid-epoch, and at the last epoch's end (12) at save()
    assert "changed after the checkpoint" not in caplog.text


def test_a_signal_at_an_epochs_last_batch_is_acted_on_at_the_boundary(tmp_path: Path) -> None:
    import signal

    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        model, opt, sched, loader = _objects()
        with cf.Checkpointer(tmp_path, policy=100, model=model, optimizer=opt, scheduler=sched, loader=loader,
                             save_on_signal=(signal.SIGUSR1,)) as ckpt:
            for x, y in loader:
                _train(model, opt, x, y)
                if loader.last_of_epoch:
                    signal.raise_signal(signal.SIGUSR1)  # recorded by checkfreq's handler only
                ckpt.step()
            assert seen == [] and _snapshots(tmp_path) == []
            sched.step()
            iter(loader)  # the boundary: the checkpoint with the epoch's work, then the signal
            assert seen == [signal.SIGUSR1] and _snapshots(tmp_path) == [BATCHES]
        model2, opt2, sched2, loader2 = _objects(seed=1)
        with cf.Checkpointer(tmp_path, model=model2, optimizer=opt2, scheduler=sched2, loader=loader2) as again:
            assert again.restore() == BATCHES
        assert sched2.get_last_lr() == [0.05]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_an_error_in_the_epochs_work_drops_the_checkpoint_waiting_for_the_boundary(tmp_path: Path) -> None:
    model, opt, sched, loader = _objects()
    with pytest.raises(RuntimeError, match="evaluation failed"), \
            cf.Checkpointer(tmp_path, policy=BATCHES, model=model, optimizer=opt, scheduler=sched,
                            loader=loader) as ckpt:
        for x, y in loader:
            _train(model, opt, x, y)
            ckpt.step()
        raise RuntimeError("evaluation failed")  # before the scheduler's step: no checkpoint holds half the work
    assert _snapshots(tmp_path) == []
