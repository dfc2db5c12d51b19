"""Crash safety: SIGKILL a training process at random moments; every restore finds a complete checkpoint."""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import random
import time
from pathlib import Path

import torch

import checkfreq as cf

KILLS = 20


class Counter(torch.nn.Module):
    """A model whose buffer counts steps in place, outside any optimizer (copied before step() returns)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def _stack() -> tuple[Counter, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Counter()
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _train_forever(directory: str, ready: multiprocessing.synchronize.Event) -> None:
    torch.set_num_threads(1)
    model, opt = _stack()
    with cf.Checkpointer(directory, policy=1, keep=2, model=model, optimizer=opt) as ckpt:
        ckpt.restore()
        ready.set()
        while True:
            opt.zero_grad()
            model.body(torch.randn(8, 512)).square().mean().backward()
            opt.step()
            model.steps += 1
            ckpt.step()


def test_sigkill_at_random_moments_never_loses_the_last_checkpoint(tmp_path: Path) -> None:
    rng = random.Random(1234)
    fork = multiprocessing.get_context("fork")
    restored_steps, killed_while_persisting = [], 0
    for _ in range(KILLS):
        ready = fork.Event()
        child = fork.Process(target=_train_forever, args=(str(tmp_path), ready))
        child.start()
        assert ready.wait(60), "the training child did not start"
        time.sleep(rng.uniform(0.05, 0.6))
        child.kill()
        child.join()
        assert child.exitcode == -9
        killed_while_persisting += any(tmp_path.glob("step_*.tmp-*"))

        model, opt = _stack()
        with cf.Checkpointer(tmp_path, model=model, optimizer=opt, rng=False) as ckpt:
            assert not any(tmp_path.glob("step_*.tmp-*")), "uncommitted staging left behind after reopening"
            step = ckpt.restore()
        if step:
            assert int(model.steps) == step, "restored tensors come from another step than the manifest"
            assert all(int(s["step"]) == step for s in opt.state_dict()["state"].values())
            restored_steps.append(step)
    assert len(restored_steps) >= KILLS - 1
    assert restored_steps == sorted(restored_steps), "a restart went back in time"
    assert killed_while_persisting >= 3, f"only {killed_while_persisting} kills hit a persist in flight"
