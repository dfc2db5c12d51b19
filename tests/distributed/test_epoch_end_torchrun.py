"""The DDP tutorial's epoch loop (a peek, ``set_epoch``, ``enumerate``) under torchrun on 2, 3 and 4
gloo ranks, with an evaluation, a best score and a ``StepLR`` after each epoch, DDP with its defaults
and nothing in the loop for checkfreq: rank 1 SIGKILLed after the checkpoint of epoch 0's end, or in
epoch 1's own work before that epoch's checkpoint, torchrun restarts the job, and every rank ends
bit-identical to an uninterrupted job (``tests/scripts/epoch_loops.py``). At 3 ranks and more that
needs DDP's rebuilt gradient buckets back after the restore (docs/exactness.md, "Under DDP")."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from helpers import SCRIPTS, run_job

POLICY = 4
"""Checkpoints at 4, 8, ...: at world size 2 an epoch is 8 steps, so every other one ends an epoch."""


def _job(workdir: Path, name: str, kill: str, nproc: int) -> list[dict]:
    out = workdir / f"{name}.pt"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=1",
        "--monitor-interval=0.1",
        str(SCRIPTS / "epoch_loops.py"),
        "peek",
        str(workdir / name),
        str(POLICY),
        kill,
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    code, output = run_job(command, env, timeout=300)
    assert code == 0, output[-4000:]
    killed = "exitcode: -9" in output  # torchrun saw a worker SIGKILLed
    assert killed == (kill != "none"), output[-4000:]
    return [torch.load(f"{out}.{rank}") for rank in range(nproc)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], list[dict]]:
    """The uninterrupted job's final states at a number of ranks (each run once)."""
    return functools.cache(lambda nproc: _job(tmp_path_factory.mktemp(f"uninterrupted{nproc}"), "run", "none", nproc))


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "kill"), [(2, "step:9"), (2, "work:1"), (3, "work:1"), (4, "step:9")])
def test_the_tutorial_loop_under_torchrun_resumes_bit_identical(
    tmp_path: Path, uninterrupted: Callable[[int], list[dict]], nproc: int, kill: str
) -> None:
    ended_job = _job(tmp_path, "run", kill, nproc)
    for rank, (ended, reference) in enumerate(zip(ended_job, uninterrupted(nproc), strict=True)):
        for name, tensor in reference["model"].items():
            assert torch.equal(ended["model"][name], tensor), f"rank {rank}: {name} differs"
        assert ended["lr"] == reference["lr"] and torch.equal(ended["rng"], reference["rng"]), rank
        assert (ended["best"], ended["step"], ended["epoch"]) == (
            reference["best"],
            reference["step"],
            reference["epoch"],
        )
