"""Acceptance: a custom loop under ``accelerate launch`` (2 CPU processes), a rank SIGKILLed and the
job launched again, ends bit-identical to an uninterrupted one, each sample once per epoch.

``scripts/accelerate_train.py``: 2 epochs of 8 optimizer steps, a checkpoint every 3. Rank 1 dies
at step 5 (restore: step 3), rank 0 at step 11 (restore: step 9, in epoch 1), the third launch
finishes. Skipped when ``accelerate`` is not installed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from helpers import SCRIPTS, assert_state_equal, run_job

pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow


def launch(workdir: Path, *args: str, killed: bool = False) -> str:
    """``accelerate launch --multi_gpu --num_processes 2``: torchrun underneath, gloo on CPU."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        str(SCRIPTS / "accelerate_train.py"),
        "--dir",
        str(workdir / "ckpt"),
        "--out",
        str(workdir / "final.pt"),
        "--batch-log",
        str(workdir / "batches.log"),
        *args,
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HOME": str(workdir / "hf"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")])),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    returncode, out = run_job(command, env)
    assert (returncode != 0) == killed, f"exit {returncode}\n{out[-4000:]}"
    return out


def batches(log: Path) -> dict[int, list[int]]:
    """Sample indices per epoch; a batch trained again after a restore must repeat its first attempt."""
    seen: dict[tuple[int, int], list[int]] = {}
    for line in log.read_text().splitlines():
        epoch, consumed, *indices = map(int, line.split())
        assert seen.setdefault((epoch, consumed), indices) == indices, f"epoch {epoch} at {consumed} differs"
    per_epoch: dict[int, list[int]] = {}
    for epoch, consumed in sorted(seen):
        per_epoch.setdefault(epoch, []).extend(seen[epoch, consumed])
    return per_epoch


def test_accelerate_loop_with_a_rank_killed_resumes_bit_identical(tmp_path: Path) -> None:
    reference, run = tmp_path / "reference", tmp_path / "run"
    reference.mkdir()
    run.mkdir()
    out = launch(reference)
    assert "rank 0 restored 0 final 16" in out and "rank 1 restored 0 final 16" in out
    launch(run, "--die-at", "5", "--die-rank", "1", killed=True)
    launch(run, "--die-at", "11", "--die-rank", "0", killed=True)
    out = launch(run)
    assert "rank 0 restored 9 final 16" in out and "rank 1 restored 9 final 16" in out

    expected, actual = torch.load(reference / "final.pt"), torch.load(run / "final.pt")
    assert_state_equal(actual["model"], expected["model"])
    assert_state_equal(actual["optimizer"], expected["optimizer"])
    assert actual["scheduler"] == expected["scheduler"]
    for epoch in range(2):
        shares = [batches(run / f"batches.log.{rank}")[epoch] for rank in (0, 1)]
        assert shares == [batches(reference / f"batches.log.{rank}")[epoch] for rank in (0, 1)]
        assert sorted(shares[0] + shares[1]) == list(range(64))
