"""Two loops users write (``tests/scripts/user_loops.py``), integrated from the README alone: the
mnist example of pytorch/examples with keep-best (``log()`` right after ``test()``, the example's
``scheduler.step()`` after it) and a nanoGPT-shaped loop (the next batch fetched before the optimizer
step, an evaluation without ``torch.no_grad()`` at the top of the loop, a learning rate set by hand,
dropout and BatchNorm). SIGKILLed at every step and in each epoch's work, each resumed run ends
bit-identical to the uninterrupted one: parameters, optimizer state, learning rate, every generator;
and ``restore(step="best")`` gives the state the run had right after that epoch's scheduler step.

Each run is a process forked from a server that imported torch once."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from user_loops import BATCHES, EPOCHS, NANO_EVAL, NANO_STEPS, Net, train

import checkfreq as cf
from helpers import run_forked


@pytest.fixture(scope="module")
def context() -> Iterator[multiprocessing.context.BaseContext]:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "checkfreq", "user_loops"])
    yield ctx


def _run(ctx, loop: str, directory: Path, policy: int, kill: str, out: Path) -> int | None:
    return run_forked(ctx, train, (loop, str(directory), policy, kill, str(out)))


def _assert_same(ended: dict, reference: dict, what: str) -> None:
    for name, tensor in reference["model"].items():
        assert torch.equal(ended["model"][name], tensor), f"{what}: {name} differs"
    for index, state in reference["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(ended["optimizer"]["state"][index][key]), torch.as_tensor(value)), (
                f"{what}: optimizer {index}.{key} differs"
            )
    assert ended["lr"] == reference["lr"], f"{what}: learning rate {ended['lr']} != {reference['lr']}"
    assert torch.equal(ended["torch"], reference["torch"]), f"{what}: torch generator differs"
    assert (ended["numpy"] == reference["numpy"]).all() and ended["python"] == reference["python"], what
    assert ended["step"] == reference["step"], what


def _kill_and_resume(ctx, tmp_path: Path, loop: str, policy: int, kill: str) -> tuple[dict, Path]:
    directory = tmp_path / f"{loop}-{policy}-{kill.replace(':', '')}"
    assert _run(ctx, loop, directory, policy, kill, tmp_path / "unused.pt") == -9, f"{kill} never came"
    out = directory.with_suffix(".pt")
    assert _run(ctx, loop, directory, policy, "none", out) == 0
    return torch.load(out, weights_only=False), directory


def _assert_best_is_the_state_after_its_epochs_scheduler_step(directory: Path, reference: dict, what: str) -> None:
    after = reference["after_epoch"]
    best_step = min(after, key=lambda step: after[step]["test_loss"])
    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    with cf.Checkpointer(directory, model=model, optimizer=optimizer, scheduler=scheduler) as ckpt:
        assert ckpt.restore(step="best") == best_step, what
    expected = after[best_step]
    for name, tensor in expected["model"].items():
        assert torch.equal(model.state_dict()[name], tensor), f"{what}: best's {name} differs"
    assert optimizer.param_groups[0]["lr"] == expected["lr"], f"{what}: best's learning rate"
    assert torch.equal(torch.get_rng_state(), expected["torch"]), f"{what}: best's torch generator"


@pytest.mark.slow
@pytest.mark.parametrize("policy", [10, 7])
def test_the_mnist_example_with_keep_best_killed_anywhere_ends_bit_identical(
    context, tmp_path: Path, policy: int
) -> None:
    reference_dir = tmp_path / f"reference-{policy}"
    assert _run(context, "mnist", reference_dir, policy, "none", tmp_path / "reference.pt") == 0
    reference = torch.load(tmp_path / "reference.pt", weights_only=False)
    _assert_best_is_the_state_after_its_epochs_scheduler_step(reference_dir, reference, "uninterrupted")
    kills = [f"step:{n}" for n in range(1, EPOCHS * BATCHES + 1)]
    kills += [f"{where}:{e}" for e in range(1, EPOCHS + 1) for where in ("test", "sched")]
    for kill in kills:
        ended, directory = _kill_and_resume(context, tmp_path, "mnist", policy, kill)
        _assert_same(ended, reference, f"killed at {kill}")
        _assert_best_is_the_state_after_its_epochs_scheduler_step(directory, reference, f"killed at {kill}")


@pytest.mark.slow
def test_a_nanogpt_shaped_prefetching_loop_killed_at_every_step_ends_bit_identical(context, tmp_path: Path) -> None:
    policy = 3
    assert _run(context, "nanogpt", tmp_path / "reference", policy, "none", tmp_path / "reference.pt") == 0
    reference = torch.load(tmp_path / "reference.pt", weights_only=False)
    kills = [f"step:{n}" for n in range(1, NANO_STEPS)] + [f"eval:{n}" for n in range(NANO_EVAL, NANO_STEPS, NANO_EVAL)]
    for kill in kills:
        _assert_same(_kill_and_resume(context, tmp_path, "nanogpt", policy, kill)[0], reference, f"killed at {kill}")
