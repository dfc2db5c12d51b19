"""The GPU benchmark (benchmarks/gpu.py) in its tiny configuration on the CPU: every mode runs and is
reported, a failing DCP baseline is reported as failed without ending the run (timings never asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from checkfreq.storage.shm_paths import SHM_DIR_ENV
from helpers import ROOT, tmpfs

sys.path.insert(0, str(ROOT))

from benchmarks import baselines, gpu  # noqa: E402


def test_every_mode_runs_and_a_failing_dcp_baseline_is_reported(
    shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken_stager(cuda: bool, async_staging: bool) -> None:
        raise KeyError(type)  # what torch 2.11's DefaultStager raises when reused

    monkeypatch.setattr(baselines, "dcp_stager", broken_stager)
    doc = gpu.main(
        [
            "--tiny",
            "--device",
            "cpu",
            "--steps",
            "9",
            "--warmup",
            "1",
            "--dir",
            str(tmp_path),
            "--json",
            str(tmp_path / "out.json"),
        ]
    )
    assert list(doc["modes"]) == list(gpu.MODES)
    for name, mode in doc["modes"].items():
        assert "error" not in mode, (name, mode)
        assert len(mode["step_s"]) == 9
    assert doc["modes"]["DCP async_save/10"]["failed"].startswith("KeyError")
    events = doc["modes"]["memory=1"]["events"]
    assert events["memory stall_s"]["n"] >= 8 and events["restore_s"]["n"] >= 1
    assert doc["modes"]["memory=1"]["restore"]["memory_s"] > 0 and doc["tier"]["memory tier copy GB/s"] > 0
    assert doc["modes"]["policy=10"]["events"]["snapshot stall_s"]["n"] == 1
    assert doc["modes"]["memory=1"]["events"]["snapshots"]["memory"] >= 8  # the tier was on: said per mode
    assert set(doc["limits"]) >= {"D2H pinned copy_ GB/s", "D2D copy_ GB/s", "disk write+fsync GB/s"}
    table = capsys.readouterr().out
    assert "| DCP async_save/10 |" in table and "failed: KeyError" in table
    assert "| snapshots (checkpoints, memory) |" in table
    assert (tmp_path / "out.json").exists() and not list(tmp_path.glob("cf-gpu-*"))  # its directory is removed


def test_a_baseline_failing_after_its_warm_up_is_reported_and_the_others_go_on() -> None:
    """As torch 2.11's reused DefaultStager did on the GPU: the first save works, the next raises."""
    from benchmarks.methods import Method, Sample
    from benchmarks.state_bench import interleave
    from benchmarks.states import build_state

    class Works(Method):
        name = "works"

        def setup(self, state: object, workdir: Path) -> None:
            pass

        def run(self) -> Sample:
            return Sample(stall=0.001)

    class FailsWhenReused(Method):
        name = "fails when reused"

        def setup(self, state: object, workdir: Path) -> None:
            self.runs = 0

        def run(self) -> Sample:
            self.runs += 1
            if self.runs > 1:
                raise KeyError(type)
            return Sample(stall=0.001)

    result = interleave([Works(), FailsWhenReused()], build_state(1), repeats=2)
    assert len(result["samples"]["works"]) == 2 and result["samples"]["fails when reused"] == []
    assert result["errors"]["fails when reused"].startswith("KeyError") and "works" not in result["errors"]


def test_a_run_without_limits_reports_each_mode_on_the_training_stream_beside_the_stall_its_events_saw(
    shm_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = gpu.main(
        [
            "--tiny",
            "--device",
            "cpu",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--modes",
            "memory=1",
            "--optimizer",
            "adamw",
            "--no-limits",
            "--dir",
            str(tmp_path),
        ]
    )
    assert "limits" not in doc and "tier" not in doc and doc["optimizer"] == "non-fused"
    mode = doc["modes"]["memory=1"]
    assert len(mode["step_s"]) == 3 and mode["steps_total"] == 4
    seen = gpu.events_stall_per_step(mode)
    assert seen is not None and seen > 0  # a memory snapshot every step: the events saw a stall
    out = capsys.readouterr().out
    assert "memory=1: mean step on the training stream" in out and "stall the events saw per step" in out
    assert "| limit" not in out


def test_a_memory_tier_without_room_fails_its_modes_and_the_tier_copy_loudly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/dev/shm too small for two slots: the tier turns itself off with a warning, and the benchmark
    says so for each memory mode and for the tier copy, rather than time disk-only checkpointing
    under a memory mode's name or die before any mode."""
    with tmpfs(tmp_path / "shm", "1m") as shm:
        monkeypatch.setenv(SHM_DIR_ENV, str(shm))
        doc = gpu.main(["--tiny", "--device", "cpu", "--steps", "3", "--warmup", "1", "--modes", "memory=1,default"])
    assert doc["tier"]["skipped"].startswith(f"no room in {shm}")
    assert "took no snapshot" in doc["modes"]["memory=1"]["failed"]
    assert "failed" not in doc["modes"]["default"]
