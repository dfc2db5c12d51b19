"""Every checkpoint is captured at its step's consistent point (docs/exactness.md): the loop's next
batch, pass or training forward, or save()/wait()/close(); whatever the loop did after ckpt.step()
is in it. save() holds the state at the moment it is called, and is taken again at the next point
when the state changed since; what is decided and dropped, or logged too late, is said once."""

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


def _objects(
    seed: int = 0,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, ResumableLoader]:
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
    with cf.Checkpointer(
        tmp_path, model=fresh_model, optimizer=fresh_opt, scheduler=fresh_sched, loader=fresh_loader
    ) as again:
        assert again.restore() == BATCHES
    assert fresh_sched.get_last_lr() == sched.get_last_lr() == [0.05]  # the epoch's scheduler step is in it
    assert fresh_loader.state_dict()["epoch"] == 1 and fresh_loader.state_dict()["consumed"] == 0
    listed = [e for e in read_events(tmp_path) if e["event"] == "snapshot"]
    assert listed[0]["epoch"] == 1  # the label agrees with the loader's state


def test_a_decision_no_point_reaches_before_the_next_update_is_taken_at_that_step(tmp_path: Path) -> None:
    """No registered loader, no forward of the registered module, no registered optimizer: the next step() is
    the first point, and the checkpoint holds that step's state, labelled with it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    with cf.Checkpointer(tmp_path, policy=2, model=model) as ckpt:
        for _ in range(3):
            loss = model[0](torch.randn(3, 4)).square().mean()  # the inner layer: the top module's hook never runs
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
            decided = ckpt.step()
            assert decided == (ckpt.global_step in (2, 3))  # 2's, taken at 3
            assert _snapshots(tmp_path) == []
    assert _snapshots(tmp_path) == [3]  # at the close, the point of step 3


def test_a_training_forward_is_the_point_of_a_loop_without_a_registered_loader(tmp_path: Path) -> None:
    """A get_batch() loop: the scheduler stepped after ckpt.step() is in the checkpoint, the generators are
    as they were at ckpt.step() (the next batch drawn before the forward is the next step's)."""
    model, opt, sched, _ = _objects()
    with cf.Checkpointer(tmp_path, policy=2, model=model, optimizer=opt, scheduler=sched) as ckpt:
        for _ in range(3):
            x = torch.randn(2, 4)  # drawn from the global generator before the forward
            _train(model, opt, x, torch.tensor([0, 1]))
            ckpt.step()
            if ckpt.global_step == 2:
                generators = torch.get_rng_state()
                expected_lr = sched.get_last_lr()
                assert _snapshots(tmp_path) == []
            sched.step()  # after ckpt.step()
        assert _snapshots(tmp_path) == [2]
    model2, opt2, sched2, _ = _objects(seed=1)
    with cf.Checkpointer(tmp_path, model=model2, optimizer=opt2, scheduler=sched2) as again:
        assert again.restore() == 2
    assert torch.equal(torch.get_rng_state(), generators)
    assert sched2.get_last_lr() == [expected_lr[0] * 0.5]


def test_save_takes_the_step_again_when_registered_state_changed_since(tmp_path: Path) -> None:
    model, opt, sched, loader = _objects()
    with cf.Checkpointer(
        tmp_path, policy=2, model=model, optimizer=opt, scheduler=sched, loader=loader, values={"best": 0.0}
    ) as ckpt:
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
    with cf.Checkpointer(
        tmp_path, model=model2, optimizer=opt2, scheduler=sched2, loader=loader2, values={"best": 0.0}
    ) as again:
        assert again.restore() == 2 and again["best"] == 3.5
    assert sched2.get_last_lr() == [0.05]
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in ended.items())


def test_save_with_a_remote_tier_copies_the_step_taken_again(tmp_path: Path) -> None:
    model, opt, sched, loader = _objects()
    with cf.Checkpointer(
        tmp_path / "local",
        remote=tmp_path / "remote",
        policy=2,
        model=model,
        optimizer=opt,
        scheduler=sched,
        loader=loader,
    ) as ckpt:
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


@pytest.mark.parametrize("change", ["scheduler", "best", "rng", "lr"])
def test_work_after_ckpt_step_and_before_the_next_batch_is_in_the_steps_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, change: str
) -> None:
    model, opt, sched, loader = _objects()
    seen: dict[int, tuple] = {}
    with (
        caplog.at_level(logging.WARNING, logger="checkfreq"),
        cf.Checkpointer(
            tmp_path, policy=3, model=model, optimizer=opt, scheduler=sched, loader=loader, values={"best": 0.0}
        ) as ckpt,
    ):
        for epoch in range(2):
            for x, y in loader:
                _train(model, opt, x, y)
                ckpt.step()
                if change == "scheduler":
                    sched.step()  # per iteration, after ckpt.step()
                elif change == "best":
                    ckpt["best"] = float(epoch + ckpt.global_step)
                elif change == "lr":
                    opt.param_groups[0]["lr"] = 0.01 * ckpt.global_step  # set by hand
                else:
                    torch.rand(1)  # random numbers drawn for other work after ckpt.step()
                seen[ckpt.global_step] = (
                    sched.get_last_lr(),
                    ckpt["best"],
                    torch.get_rng_state(),
                    opt.param_groups[0]["lr"],
                )
    assert _snapshots(tmp_path) == [3, 6]
    assert "changed after" not in caplog.text
    model2, opt2, sched2, loader2 = _objects(seed=1)
    with cf.Checkpointer(
        tmp_path, model=model2, optimizer=opt2, scheduler=sched2, loader=loader2, values={"best": 0.0}
    ) as again:
        assert again.restore(step=6) == 6
        lr, best, rng, group_lr = seen[6]
        assert (sched2.get_last_lr(), again["best"], opt2.param_groups[0]["lr"]) == (lr, best, group_lr)
        assert torch.equal(torch.get_rng_state(), rng)


def test_a_second_loader_left_at_its_last_batch_never_holds_checkpoints_back(tmp_path: Path) -> None:
    model, opt, sched, loader = _objects()
    validation = ResumableLoader(Points(), batch_size=BATCHES * 2)  # one batch
    with cf.Checkpointer(tmp_path, policy=2, model=model, optimizer=opt, loader=loader, validation=validation) as ckpt:
        next(iter(validation))  # a peek: the validation loader sits at its epoch's last batch
        for x, y in loader:
            _train(model, opt, x, y)
            ckpt.step()
    assert _snapshots(tmp_path) == [2, 4]  # 4 at the close's point


def test_a_prefetching_loop_hands_the_batch_fetched_before_the_update_to_the_resumed_run(tmp_path: Path) -> None:
    model, opt, _, loader = _objects()
    taken = []
    with cf.Checkpointer(tmp_path, policy=2, model=model, optimizer=opt, loader=loader) as ckpt:
        batches = iter(loader)
        x, y = next(batches)
        for _ in range(3):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)  # the point of the step before: a training forward
            taken.append(x[:, 0].tolist())
            x, y = next(batches)  # the next batch, fetched before this step's update
            loss.backward()
            opt.step()
            ckpt.step()
    model2, opt2, _, loader2 = _objects(seed=1)
    with cf.Checkpointer(tmp_path, model=model2, optimizer=opt2, loader=loader2) as again:
        assert again.restore(step=2) == 2
        assert next(iter(loader2))[0][:, 0].tolist() == taken[2]  # the third batch: neither skipped nor repeated


def test_a_learning_rate_set_by_hand_or_a_buffer_replaced_makes_save_take_the_step_again(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with cf.Checkpointer(tmp_path, policy=100, model=model, optimizer=opt) as ckpt:
        _train(model, opt, torch.randn(3, 4), torch.tensor([0, 1, 2]))
        ckpt.step()
        ckpt.save(blocking=True)
        opt.param_groups[0]["lr"] = 0.5
        ckpt.save(blocking=True)
        model[1].running_mean = torch.zeros(4)  # a new tensor, version 0
        ckpt.save(blocking=True)
        ckpt.save(blocking=True)  # nothing changed
        assert _snapshots(tmp_path) == [1, 1, 1]


def test_log_after_the_steps_checkpoint_was_captured_is_named_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt, _, loader = _objects()
    keep = cf.Retention(3, best=("val_loss", "min"))
    with (
        caplog.at_level(logging.WARNING, logger="checkfreq"),
        cf.Checkpointer(tmp_path, policy=2, keep=keep, model=model, optimizer=opt, loader=loader) as ckpt,
    ):
        for x, y in loader:
            if ckpt.global_step == 2:
                ckpt.log(val_loss=0.5)  # after the loader handed out this step's batch: step 2's point has passed
            _train(model, opt, x, y)
            ckpt.step()
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("log(val_loss=0.5) at step 2")]
    assert len(warnings) == 1 and "captured (at the loader's next batch)" in warnings[0]


def test_the_loop_with_its_work_before_ckpt_step_and_after_the_epoch_warns_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt, sched, loader = _objects()
    with (
        caplog.at_level(logging.WARNING, logger="checkfreq"),
        cf.Checkpointer(
            tmp_path, policy=3, model=model, optimizer=opt, scheduler=sched, loader=loader, values={"best": 0.0}
        ) as ckpt,
    ):
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
        with cf.Checkpointer(
            tmp_path,
            policy=100,
            model=model,
            optimizer=opt,
            scheduler=sched,
            loader=loader,
            save_on_signal=(signal.SIGUSR1,),
        ) as ckpt:
            for number, (x, y) in enumerate(loader, start=1):
                _train(model, opt, x, y)
                if number == BATCHES:  # the epoch's last batch
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


def test_an_error_in_the_epochs_work_drops_the_checkpoint_waiting_for_its_point_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, opt, sched, loader = _objects()
    with (
        caplog.at_level(logging.WARNING, logger="checkfreq"),
        pytest.raises(RuntimeError, match="evaluation failed"),
        cf.Checkpointer(tmp_path, policy=BATCHES, model=model, optimizer=opt, scheduler=sched, loader=loader) as ckpt,
    ):
        for x, y in loader:
            _train(model, opt, x, y)
            assert ckpt.step() == (ckpt.global_step == BATCHES)
        raise RuntimeError("evaluation failed")  # before the scheduler's step: no checkpoint holds half the work
    assert _snapshots(tmp_path) == []
    dropped = [r.getMessage() for r in caplog.records if "was not taken" in r.getMessage()]
    assert len(dropped) == 1 and f"decided at step {BATCHES}" in dropped[0] and "RuntimeError" in dropped[0]


def test_a_compiled_modules_forward_is_the_point_and_the_capture_stays_out_of_its_graph(tmp_path: Path) -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, opt, sched, loader = _objects()
    with cf.Checkpointer(tmp_path, policy=2, model=model, optimizer=opt, scheduler=sched) as ckpt:
        compiled = torch.compile(model, backend="eager")
        for _ in range(5):
            opt.zero_grad()
            F.cross_entropy(compiled(torch.randn(2, 4)), torch.tensor([0, 1])).backward()
            opt.step()
            ckpt.step()
            sched.step()  # after ckpt.step(): in the step's checkpoint, captured at the compiled forward
        assert _snapshots(tmp_path) == [2, 4]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # the capture traced into no graph
    model2, opt2, sched2, _ = _objects(seed=1)
    with cf.Checkpointer(tmp_path, model=model2, optimizer=opt2, scheduler=sched2) as again:
        assert again.restore(step=4) == 4
    assert sched2.get_last_lr() == [0.1 * 0.5**4]
