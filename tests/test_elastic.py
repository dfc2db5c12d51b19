"""Resizing a DDP job keeps it on course: the same global batch at every optimizer step.

A job of ``scripts/elastic_train.py`` (96 samples, global batches of 16, 2 epochs: 12 optimizer
steps, a checkpoint every 2) runs uninterrupted at world size 4, and again killed at 4, resumed at
2 (and 1) and finished at 4. Every step must take the samples the uninterrupted run took, each
sample once per epoch, and the result must equal the uninterrupted run's up to the order of the
floating-point sums (``TOLERANCE``).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import run_job
from elastic_train import command, read_steps, step_samples

SAMPLES, GLOBAL_BATCH, EPOCHS = 96, 16, 2
STEPS = SAMPLES // GLOBAL_BATCH * EPOCHS
# The gradient of a step is the same mean over the same 16 samples at every world size, but summed
# in another order (per rank, then DDP's average over ranks, then over micro-batches): float32
# results differ in the last bits, and AdamW carries that over 12 steps. Measured: at most 3e-8 on
# parameters of magnitude 0.1 to 0.4 (a few units in the last place); the bound leaves room for
# other CPUs' summation kernels while failing on any other batch composition (which moves the
# parameters by 1e-3 or more).
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def launch(work: Path, nproc: int, log: str, *extra: str, expect_success: bool = True) -> str:
    """One job of elastic_train.py on ``nproc`` ranks under torchrun (0: one plain process); its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    code, out = run_job(command(nproc, "--ckpt-dir", str(work / "ckpt"), "--final", str(work / "final.pt"),
                                "--step-log", str(work / log), "--samples", str(SAMPLES),
                                "--global-batch", str(GLOBAL_BATCH), "--epochs", str(EPOCHS), *extra), env, timeout=240)
    assert (code == 0) == expect_success, out[-4000:]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("uninterrupted")
    launch(work, 4, "steps.log")
    return work


@pytest.mark.slow
@pytest.mark.parametrize("resizes", [
    pytest.param(((2, 9, ()),), id="4-2-4"),
    pytest.param(((2, 7, ("--micro", "4")), (0, 10, ("--micro", "4"))), id="4-2-1-4-micro"),
])
def test_a_resized_job_takes_the_uninterrupted_runs_global_batches(reference: Path, tmp_path: Path, resizes) -> None:
    """Killed at 4 ranks after step 5 (restored at 4), resumed on fewer ranks, finished at 4 again.

    With ``--micro 4`` each rank takes at most 4 samples per batch: at 2 ranks a step is 2
    micro-batches per rank, in one process 4.
    """
    launch(tmp_path, 4, "run0.log", "--die", "5", expect_success=False)
    restored = [4]
    for number, (nproc, stop, extra) in enumerate(resizes, start=1):
        out = launch(tmp_path, nproc, f"run{number}.log", "--stop-at", str(stop), *extra)
        accumulation = GLOBAL_BATCH // max(nproc, 1) // 4 if extra else 1
        assert out.count(f"restored step={restored[-1]} accumulation={accumulation}") == max(nproc, 1), out[-3000:]
        restored.append(stop)
    out = launch(tmp_path, 4, "last.log")
    assert out.count(f"world=4 restored step={restored[-1]} accumulation=1") == 4

    logs = [tmp_path / f"run{n}.log" for n in range(len(resizes) + 1)] + [tmp_path / "last.log"]
    steps, expected = read_steps(*logs), read_steps(reference / "steps.log")
    assert sorted(steps) == list(range(1, STEPS + 1))
    worlds = {step: {world for _, _, world in ranks.values()} for step, ranks in steps.items()}
    assert worlds[5] == {2} and worlds[STEPS] == {4}  # step 5 was run again on 2 ranks after the kill
    assert step_samples(steps) == step_samples(expected)  # exact: the same samples at every step
    per_epoch = SAMPLES // GLOBAL_BATCH
    for epoch in range(EPOCHS):
        seen = Counter(i for step in range(epoch * per_epoch + 1, (epoch + 1) * per_epoch + 1)
                       for i in step_samples(steps)[step])
        assert sorted(seen) == list(range(SAMPLES)) and set(seen.values()) == {1}, epoch
    losses = torch.tensor([steps[s][0][0] for s in sorted(steps)], dtype=torch.float64)
    torch.testing.assert_close(losses, torch.tensor([expected[s][0][0] for s in sorted(steps)],
                                                    dtype=torch.float64), **TOLERANCE)

    final, uninterrupted = torch.load(tmp_path / "final.pt"), torch.load(reference / "final.pt")
    assert final["scheduler"] == uninterrupted["scheduler"]  # the schedule counted the same optimizer steps
    torch.testing.assert_close(final["model"], uninterrupted["model"], **TOLERANCE)
    torch.testing.assert_close(final["optimizer"]["state"], uninterrupted["optimizer"]["state"], **TOLERANCE)
