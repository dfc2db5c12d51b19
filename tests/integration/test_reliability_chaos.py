"""The fault-injection campaign in its short form: ~30 real SIGKILLs of a training job.

The full campaign (>= 200 kills) is ``python benchmarks/chaos.py``; see docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import BENCHMARKS

HOOKED = {"snapshot", "copy", "write", "fsync", "rename", "retention"}
pytestmark = pytest.mark.slow


def test_thirty_kills_lose_nothing_and_resume_exactly(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "chaos.py"),
            "--kills",
            "30",
            "--seed",
            "1",
            "--workdir",
            str(tmp_path / "runs"),
            "--json",
            str(out),
            "--no-report",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.exists(), proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert proc.returncode == 0, f"{doc['problems']}\n{proc.stderr[-3000:]}"
    assert doc["kills"] >= 30
    assert HOOKED <= set(doc["kills_by_phase"]), doc["kills_by_phase"]  # every phase of a checkpoint was hit
    assert doc["unrestorable"] == 0 and doc["visible_checkpoints_corrupt"] == 0 and doc["hangs"] == 0
    assert doc["visible_checkpoints_verified"] > doc["kills"]
    assert doc["runs"] >= 3 and doc["runs_bit_identical"] == doc["runs"], doc["problems"]
    assert (
        doc["restores_from_checkpoint"] + doc["fresh_starts_after_kill"] == doc["kills"] - doc["kills_during_startup"]
    )
    assert doc["max_lost_steps"] <= doc["lost_bound_steps"]


def test_thirty_kills_with_the_memory_tier_restore_the_newest_state_of_any_tier(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    shm = tmp_path / "shm"  # the regions on the ordinary filesystem: same protocol, isolated from /dev/shm
    shm.mkdir()
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "chaos.py"),
            "--kills",
            "30",
            "--seed",
            "2",
            "--memory",
            "1",
            "--workdir",
            str(tmp_path / "runs"),
            "--json",
            str(out),
            "--no-report",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "CHECKFREQ_SHM_DIR": str(shm)},
    )
    assert out.exists(), proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert proc.returncode == 0, f"{doc['problems']}\n{proc.stderr[-3000:]}"
    assert doc["kills"] >= 30 and {"snapshot", "copy", "header"} <= set(doc["kills_by_phase"]), doc["kills_by_phase"]
    assert doc["restores_not_newest"] == 0 and doc["unrestorable"] == 0 and doc["hangs"] == 0
    assert doc["restores_from_memory"] > doc["kills"] // 2  # memory holds a newer state than disk after most kills
    assert doc["runs"] >= 3 and doc["runs_bit_identical"] == doc["runs"], doc["problems"]
    assert doc["max_lost_steps"] <= doc["interval"]  # a kill mid-copy during a persist falls back to the persisted step
