"""Shared fixtures. The plain helpers (paths, small real models, training steps, jobs) are in helpers.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from helpers import SCRIPTS, TESTS, free_port

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

sys.path.append(str(SCRIPTS))  # tests that import a training script import its helpers too

JOB_FOLDERS = ("distributed", "integration")
"""The folders whose tests run real jobs of several processes (torchrun, DDP, Lightning, the HF Trainer,
kills and node losses): the slow tier."""


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of :data:`JOB_FOLDERS` ``slow``. ``python -m pytest -q`` (no path, no ``-m``) runs
    the quick tier, the slow one deselected; ``python -m pytest -q -m slow`` the slow tier; a path given
    runs what it names. CI runs both tiers, so every test runs there."""
    for item in items:
        if item.path.relative_to(TESTS).parts[0] in JOB_FOLDERS:
            item.add_marker(pytest.mark.slow)
    if config.args_source is pytest.Config.ArgsSource.TESTPATHS and not config.option.markexpr:
        slow = [item for item in items if item.get_closest_marker("slow") is not None]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if item.get_closest_marker("slow") is None]


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture
def shm_dir(monkeypatch: pytest.MonkeyPatch):
    """A private directory on the real /dev/shm tmpfs for this test's memory-tier regions."""
    from checkfreq.storage.shm_paths import SHM_DIR_ENV

    path = Path("/dev/shm") / f"checkfreq-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    monkeypatch.setenv(SHM_DIR_ENV, str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


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
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
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
