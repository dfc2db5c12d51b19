"""Shared fixtures: small real models and training steps."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real S3-protocol server (moto's standalone server) on a free loopback port, for the session."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    port = free_port()
    log = (tmp_path_factory.mktemp("moto") / "server.log").open("w")
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"moto server did not start (exit {proc.poll()})")
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(10)
    log.close()
