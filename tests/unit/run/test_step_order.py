"""``ckpt.step()`` before ``optimizer.step()`` is refused at a session's first step; correct loops never meet it.

Called before, every checkpoint labelled step N would hold the state after N - 1 updates and a
resume would lose one update. A session begins with the Checkpointer, ``restore()`` or
``start_at()`` (which counts from a state loaded elsewhere). Also here: a checkpoint that does not
fit lists every object's differences, and a model wrapped differently from the one saved gets the
prefix hint.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import checkfreq as cf
from checkfreq.cli import app
from helpers import assert_state_equal, make_model, train_step

ORDER = "before any registered optimizer stepped"


def loss_of(model: torch.nn.Module) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 3, (16,)))


def test_step_before_the_optimizer_step_is_refused_at_the_first_step(tmp_path: Path) -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with cf.Checkpointer(tmp_path, model=model, optimizer=optimizer, policy=1) as ckpt:
        loss_of(model).backward()
        with pytest.raises(cf.UsageError, match=f"step 1 {ORDER}.*right after optimizer.step"):
            ckpt.step()
        assert ckpt.global_step == 0
    assert not list(tmp_path.glob("step_*"))  # no checkpoint labelled with the wrong step


def test_step_before_the_optimizer_step_after_a_restore_is_refused(tmp_path: Path) -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with cf.Checkpointer(tmp_path, model=model, optimizer=optimizer, policy=2) as ckpt:
        for _ in range(2):
            train_step(model, optimizer)
            ckpt.step()
    with cf.Checkpointer(tmp_path, model=model, optimizer=optimizer, policy=2) as ckpt:
        assert ckpt.restore() == 2
        with pytest.raises(cf.UsageError, match=f"step 3 {ORDER}"):
            ckpt.step()


def test_correct_loops_never_meet_it(tmp_path: Path) -> None:
    """Plain, gradient accumulation (step() after every second micro-batch), after a restore, and
    after start_at(): no error, and the check watches only each session's first step."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with cf.Checkpointer(tmp_path, model=model, optimizer=optimizer, policy=3) as ckpt:
        for micro_batch in range(12):
            (loss_of(model) / 2).backward()
            if micro_batch % 2 == 1:
                optimizer.step()
                optimizer.zero_grad()
                ckpt.step()
        ckpt.step()  # a second step() without an optimizer step is a loop's own business
        assert ckpt.global_step == 7
    with cf.Checkpointer(tmp_path, model=model, optimizer=optimizer, policy=3) as ckpt:
        assert ckpt.restore() == 7  # 6's checkpoint: no point came before the next step(), so it is of step 7
        train_step(model, optimizer)
        ckpt.step()
        assert ckpt.global_step == 8


def test_a_step_a_grad_scaler_skipped_is_not_taken_for_the_wrong_order(tmp_path: Path) -> None:
    """An overflow at the first step makes the GradScaler skip optimizer.step() (the float16 warm-up):
    a correct loop then calls step() with no optimizer step, and must not be refused."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    before = {k: v.clone() for k, v in model.state_dict().items() if "running" not in k and "num_batches" not in k}
    with cf.Checkpointer(tmp_path, model=model, optimizer=optimizer, scaler=scaler, policy=1) as ckpt:
        scaler.scale(loss_of(model) * 16).backward()  # overflows float32
        scaler.step(optimizer)
        scaler.update()
        assert scaler.get_scale() < 2.0**127  # the step was skipped
        assert_state_equal({k: v for k, v in model.state_dict().items() if k in before}, before)
        ckpt.step()
        assert ckpt.global_step == 1


def test_a_grad_scaler_that_did_not_skip_does_not_hide_the_wrong_order(tmp_path: Path) -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    with cf.Checkpointer(tmp_path, model=model, optimizer=optimizer, scaler=scaler, policy=1) as ckpt:
        scaler.scale(loss_of(model)).backward()
        with pytest.raises(cf.UsageError, match=ORDER):
            ckpt.step()


def test_start_at_counts_from_a_state_loaded_elsewhere(tmp_path: Path) -> None:
    """start_at(5): the next step() is 6 (and the session's first, checked for the order); a directory
    that holds checkpoints is refused at start_at(), before anything is written."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with cf.Checkpointer(tmp_path, model=model, optimizer=optimizer, policy=1) as ckpt:
        ckpt.start_at(5)
        with pytest.raises(cf.UsageError, match=f"step 6 {ORDER}"):
            ckpt.step()
        train_step(model, optimizer)
        ckpt.step()
        with pytest.raises(cf.InvalidArgumentError):
            ckpt.start_at(-1)
    assert [p.name for p in tmp_path.glob("step_*")] == ["step_000000006"]
    with cf.Checkpointer(tmp_path, model=model, optimizer=optimizer) as ckpt:
        with pytest.raises(cf.ExistingCheckpointsError, match="newest at step 6"):
            ckpt.start_at(0)


def _saved(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    with cf.Checkpointer(directory, model=model, optimizer=optimizer, policy=1) as ckpt:
        train_step(model, optimizer)
        ckpt.step()


def test_a_checkpoint_that_does_not_fit_lists_every_object(tmp_path: Path) -> None:
    """A model shape misfit does not hide an AdamW -> SGD misfit, nor a missing object."""
    model = make_model()
    _saved(tmp_path, model, torch.optim.AdamW(model.parameters()))
    wider = make_model(width=16)
    scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(wider.parameters()), 2)
    with cf.Checkpointer(
        tmp_path, model=wider, optimizer=torch.optim.SGD(wider.parameters()), scheduler=scheduler
    ) as ckpt:
        with pytest.raises(cf.StateMismatchError) as info:
            ckpt.restore()
    lines = str(info.value).splitlines()
    assert lines[0] == f"checkpoint step_000000001 of {tmp_path} does not fit the registered objects:"
    assert lines[1] == "- checkpoint holds no state for scheduler"
    assert lines[2].startswith("- checkpoint does not fit 'model': ") and (
        "0.weight: shape (32, 8) in checkpoint, (16, 8) in model" in lines[2]
    )
    assert lines[3] == (
        "- checkpoint does not fit 'optimizer': it was written by a torch.optim.adamw.AdamW, "
        "this optimizer is a torch.optim.sgd.SGD"
    )
    assert (
        len(lines) == 5
        and "A run whose model or optimizer changed on purpose is a new run: give it a directory of its own."
        in lines[4]
    )

    # the way on it names: export the weights, and load those that fit into the changed model
    export = re.search(r"\(checkfreq (export .*?)\)", lines[4]).group(1)  # type: ignore[union-attr]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        result = CliRunner().invoke(app, export.split())
        assert result.exit_code == 0, result.output
        saved = torch.load("model.pt", weights_only=True)
    fits = {k: v for k, v in saved.items() if k in wider.state_dict() and v.shape == wider.state_dict()[k].shape}
    assert fits and set(fits) < set(saved)
    wider.load_state_dict(fits, strict=False)
    assert all(torch.equal(wider.state_dict()[k], v) for k, v in fits.items())


@pytest.mark.parametrize("wrap", ["data_parallel", "compile"])
def test_a_model_wrapped_differently_gets_the_prefix_hint(tmp_path: Path, wrap: str) -> None:
    model = make_model()
    wrapped = torch.nn.DataParallel(model) if wrap == "data_parallel" else torch.compile(model)
    prefix = "module." if wrap == "data_parallel" else "_orig_mod."
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _saved(tmp_path / "bare", model, optimizer)
    _saved(tmp_path / "wrapped", wrapped, optimizer)

    with cf.Checkpointer(tmp_path / "bare", model=wrapped, optimizer=optimizer) as ckpt:
        with pytest.raises(
            cf.StateMismatchError,
            match=f"only by the prefix '{prefix}', which this model's keys carry.*register the unwrapped module",
        ):
            ckpt.restore()
    with cf.Checkpointer(tmp_path / "wrapped", model=model, optimizer=optimizer) as ckpt:
        with pytest.raises(
            cf.StateMismatchError,
            match=f"only by the prefix '{prefix}', which the checkpoint's keys carry.*wrapped the same way",
        ):
            ckpt.restore()
    inner = wrapped.module if wrap == "data_parallel" else wrapped._orig_mod
    with cf.Checkpointer(tmp_path / "bare", model=inner, optimizer=optimizer) as ckpt:  # the fix the hint names
        assert ckpt.restore() == 1


def test_keys_that_differ_otherwise_get_no_prefix_hint(tmp_path: Path) -> None:
    model = make_model()
    _saved(tmp_path, model, torch.optim.SGD(model.parameters()))
    renamed = torch.nn.Sequential()
    for i, layer in enumerate(make_model()):
        renamed.add_module(f"layer{i}", layer)
    with cf.Checkpointer(tmp_path, model=renamed, optimizer=torch.optim.SGD(renamed.parameters())) as ckpt:
        with pytest.raises(cf.StateMismatchError, match="missing keys: layer0") as info:
            ckpt.restore()
    assert "prefix" not in str(info.value)
