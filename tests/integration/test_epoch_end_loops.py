"""The epoch loops people write (``tests/scripts/epoch_loops.py``), SIGKILLed at a step or in an
epoch's own work and run again, end bit-identical to an uninterrupted run: parameters, optimizer,
learning rate, torch generator and the best score. Nothing in the loops helps checkfreq: the
checkpoint due at an epoch's last batch is taken at the epoch boundary (docs/exactness.md, "Epochs").
And the final checkpoint of every run restores exactly the state the run ended with.

Each run is a process of its own, forked from a server that imported torch once (fast, and a
real SIGKILL at any point, a persist in flight included)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from epoch_loops import BATCHES, EPOCHS, MAX_STEPS, SHAPES_AFTER, Run, train

from helpers import run_forked

STEPS = EPOCHS * BATCHES


@pytest.fixture(scope="module")
def context() -> Iterator[multiprocessing.context.BaseContext]:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "checkfreq", "epoch_loops"])
    yield ctx


def _run(
    ctx: multiprocessing.context.BaseContext, shape: str, directory: Path, policy: int, kill: str, out: Path
) -> int | None:
    return run_forked(ctx, train, (shape, str(directory), policy, kill, str(out)))


def _assert_same(ended: dict, reference: dict, what: str) -> None:
    for name, tensor in reference["model"].items():
        assert torch.equal(ended["model"][name], tensor), f"{what}: parameter {name} differs"
    for index, state in reference["optimizer"]["state"].items():
        assert torch.equal(ended["optimizer"]["state"][index]["momentum_buffer"], state["momentum_buffer"]), what
    assert ended["lr"] == reference["lr"], f"{what}: learning rate {ended['lr']} != {reference['lr']}"
    assert torch.equal(ended["rng"], reference["rng"]), f"{what}: torch generator differs"
    assert (ended["best"], ended["step"], ended["epoch"]) == (reference["best"], reference["step"], reference["epoch"])
    assert ended["seen"] == reference["seen"], what


def _kill_and_resume(ctx, tmp_path: Path, shape: str, policy: int, kill: str) -> dict:
    directory = tmp_path / f"{shape}-{policy}-{kill.replace(':', '')}"
    assert _run(ctx, shape, directory, policy, kill, tmp_path / "unused.pt") == -9, f"{kill} never came"
    out = directory.with_suffix(".pt")
    assert _run(ctx, shape, directory, policy, "none", out) == 0
    return torch.load(out)


def _reference(ctx, tmp_path: Path, shape: str, policy: int) -> dict:
    out = tmp_path / f"{shape}-{policy}-reference.pt"
    assert _run(ctx, shape, tmp_path / f"{shape}-{policy}-reference", policy, "none", out) == 0
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("policy", [8, 4])
def test_the_classic_loop_killed_at_every_step_ends_bit_identical(context, tmp_path: Path, policy: int) -> None:
    reference = _reference(context, tmp_path, "classic", policy)
    kills = [f"step:{n}" for n in range(1, STEPS + 1)] + [f"work:{e}" for e in range(EPOCHS)]
    for kill in kills:
        _assert_same(_kill_and_resume(context, tmp_path, "classic", policy, kill), reference, f"killed at {kill}")


@pytest.mark.parametrize("shape", ["peek", "max_steps", "while_true", "accumulate", *SHAPES_AFTER])
def test_other_loop_shapes_killed_around_epoch_ends_end_bit_identical(context, tmp_path: Path, shape: str) -> None:
    policy = 4
    reference = _reference(context, tmp_path, shape, policy)
    last = MAX_STEPS if shape.startswith("max_steps") else STEPS // (2 if shape.startswith("accumulate") else 1)
    per_epoch = BATCHES // (2 if shape.startswith("accumulate") else 1)
    ends = [per_epoch * e for e in range(1, EPOCHS) if per_epoch * e < last]
    kills = sorted({f"step:{n}" for end in ends[:3] for n in (end - 1, end, end + 1)} | {"work:1", f"step:{last - 1}"})
    for kill in kills:
        _assert_same(_kill_and_resume(context, tmp_path, shape, policy, kill), reference, f"{shape} killed at {kill}")


@pytest.mark.parametrize("shape", ["classic", "max_steps"])
def test_the_final_checkpoint_holds_the_state_the_run_ended_with(context, tmp_path: Path, shape: str) -> None:
    """With ``policy=4`` the last step is checkpointed by the policy too: the closing ``save()`` takes
    it again with the epoch's work (the classic loop's last scheduler step and evaluation)."""
    ended = _reference(context, tmp_path, shape, 4)
    before = torch.get_rng_state()
    try:
        run = Run(str(tmp_path / f"{shape}-4-reference"), 4, "none", shape)  # restores the final checkpoint
        restored = {
            "model": run.model.state_dict(),
            "optimizer": run.opt.state_dict(),
            "rng": torch.get_rng_state(),
            "lr": run.opt.param_groups[0]["lr"],
            "best": run.ckpt["best"],
            "seen": run.ckpt["seen"],
            "step": run.ckpt.global_step,
            "epoch": run.loader.epoch,
        }
        run.ckpt.close()
    finally:
        torch.set_rng_state(before)
    _assert_same(restored, ended, "the final checkpoint")
