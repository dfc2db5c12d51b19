"""Kill and resume on the GPU, from disk and from the memory tier: bit-identical to a run never killed
(tests/scripts/gpu_resume.py). The CUDA runs are for a machine with a GPU (benchmarks/gpu_check.sh);
the CPU run of the memory tier keeps the script itself tested everywhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkfreq.run.events import read_events
from helpers import SCRIPTS

SCRIPT = SCRIPTS / "gpu_resume.py"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def run(directory: Path, out: Path, device: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--dir", str(directory), "--out", str(out), "--device", device, *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("device", "tier"),
    [
        ("cpu", "memory"),
        pytest.param("cuda", "disk", marks=[pytest.mark.cuda, cuda]),
        pytest.param("cuda", "memory", marks=[pytest.mark.cuda, cuda]),
    ],
)
def test_a_killed_run_resumes_bit_identical(shm_dir: Path, tmp_path: Path, device: str, tier: str) -> None:
    extra = ["--memory", "1", "--policy", "1000"] if tier == "memory" else ["--policy", "5"]
    reference = run(tmp_path / "reference", tmp_path / "reference.safetensors", device, *extra)
    assert reference.returncode == 0, reference.stderr[-3000:]
    killed = run(tmp_path / "run", tmp_path / "unused.safetensors", device, *extra, "--die-at", "13")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = run(tmp_path / "run", tmp_path / "resumed.safetensors", device, *extra)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"ready {13 if tier == 'memory' else 10}" in resumed.stdout
    restore = [e for e in read_events(tmp_path / "run") if e["event"] == "restore"][-1]
    assert restore["tier"] == ("memory" if tier == "memory" else "local")
    expected, got = load_file(tmp_path / "reference.safetensors"), load_file(tmp_path / "resumed.safetensors")
    assert expected.keys() == got.keys() and len(expected) > 50
    for key, value in expected.items():
        assert torch.equal(value, got[key]), key
