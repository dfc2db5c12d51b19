"""Acceptance: a Lightning fit with CheckFreqCallback, SIGKILLed and resumed, ends bit-identical.

Each run is ``scripts/lightning_train.py`` in a child process: 2 epochs of 9 optimizer steps, a
checkpoint every 3 steps. The first run dies mid-epoch 0 at step 5 (restore: step 3, mid-epoch),
the second at step 10 (restore: step 9, the end of epoch 0), the third finishes.
Skipped when the ``lightning`` extra is not installed.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, assert_state_equal

pytest.importorskip("lightning")
pytestmark = pytest.mark.slow


def fit(workdir: Path, name: str, *args: str, killed: bool = False) -> str:
    command = [sys.executable, str(SCRIPTS / "lightning_train.py"), "--dir", str(workdir / "ckpt"),
               "--out", str(workdir / f"{name}.pt"), "--log", str(workdir / "batches.log"), *args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    expected = -signal.SIGKILL if killed else 0
    assert proc.returncode == expected, f"{name}: exit {proc.returncode}\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def batches(log: Path) -> dict[int, list[int]]:
    """Sample indices per epoch in batch order; a replayed batch must repeat its first attempt."""
    seen: dict[tuple[int, int], list[int]] = {}
    for line in log.read_text().splitlines():
        epoch, batch_idx, *indices = map(int, line.split())
        first = seen.setdefault((epoch, batch_idx), indices)
        assert first == indices, f"epoch {epoch} batch {batch_idx} differs when replayed"
    per_epoch: dict[int, list[int]] = {}
    for epoch, batch_idx in sorted(seen):
        per_epoch.setdefault(epoch, []).extend(seen[epoch, batch_idx])
    return per_epoch


def test_killed_and_resumed_fit_is_bit_identical(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    reference.mkdir()
    assert "restored 0 final 18" in fit(reference, "final")

    run = tmp_path / "run"
    run.mkdir()
    fit(run, "killed", "--die-at", "5", killed=True)
    fit(run, "killed", "--die-at", "10", killed=True)
    assert "restored 9 final 18" in fit(run, "final")

    expected, actual = torch.load(reference / "final.pt"), torch.load(run / "final.pt")
    assert_state_equal(actual["model"], expected["model"])
    assert_state_equal(actual["optimizer"], expected["optimizer"])
    assert actual["scheduler"] == expected["scheduler"]
    order = [tuple(map(int, line.split()[:2])) for line in (run / "batches.log").read_text().splitlines()]
    # Run 1 trains batches 0-4 of epoch 0; run 2 restores step 3 and replays batches 3-4, then
    # goes on to batch 0 of epoch 1; run 3 restores step 9 (end of epoch 0) and replays that batch.
    assert order == [(0, i) for i in range(5)] + [(0, i) for i in range(3, 9)] + [(1, i) for i in (0, *range(9))]
    log = batches(run / "batches.log")
    assert log == batches(reference / "batches.log")
    for indices in log.values():
        assert sorted(indices) == list(range(72))

