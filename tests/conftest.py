"""Shared fixtures: small real models and training steps."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.append(str(SCRIPTS))  # tests that import a training script import its helpers too


def make_model(seed: int = 0, width: int = 32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.BatchNorm1d(width), torch.nn.ReLU(), torch.nn.Linear(width, 3)
    )


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: int = 16) -> float:
    x = torch.randn(batch, 8)
    y = torch.randint(0, 3, (batch,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def assert_state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), key
        elif isinstance(x, dict):
            assert_state_equal(x, y)
        elif isinstance(x, (list, tuple)):
            assert len(x) == len(y), key
            for i, (u, v) in enumerate(zip(x, y)):
                assert_state_equal({i: u}, {i: v})
        else:
            assert x == y, key


@pytest.fixture
def python() -> str:
    return sys.executable


def run_job(command: list[str], env: dict[str, str], timeout: float = 300) -> tuple[int, str]:
    """Run a job in a session of its own and return (exit status, output); nothing of it outlives it."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, out


@pytest.fixture
def shm_dir(monkeypatch: pytest.MonkeyPatch):
    """A private directory on the real /dev/shm tmpfs for this test's memory-tier regions."""
    from checkfreq.storage.shm import SHM_DIR_ENV

    path = Path("/dev/shm") / f"checkfreq-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    monkeypatch.setenv(SHM_DIR_ENV, str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)
