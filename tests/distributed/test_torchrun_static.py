"""Restarts in torchrun's static launch form (``--master-port``), whose store outlives the workers.

The static form's store keeps every key a dead worker wrote, so a restarted rank can read its
predecessor's rendezvous address. checkfreq's own groups (:mod:`checkfreq.ranks.groups`) never read one;
the job's default group gets keys of its own per attempt as docs/distributed.md shows
(``ddp_train.py --attempt-store``). Real torchrun, gloo, CPU, real SIGKILLs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from checkfreq.errors import CheckfreqError
from checkfreq.ranks.groups import agree_on_token
from helpers import (
    SCRIPTS,
    assert_each_sample_once_per_epoch,
    assert_state_equal,
    ddp_train_args,
    final_states,
    free_port,
    incarnations,
)

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _train_args(workdir: Path, *extra: str) -> list[str]:
    return [str(SCRIPTS / "ddp_train.py"), *ddp_train_args(workdir, *extra)]


def _static(workdir: Path, *extra: str) -> subprocess.Popen[str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--master-port={free_port()}",
        "--nproc-per-node=2",
        "--max-restarts=2",
        "--monitor-interval=0.1",
        *_train_args(workdir, "--attempt-store", *extra),
    ]
    return subprocess.Popen(
        command,
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen[str]) -> str:
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted static-form job."""
    workdir = tmp_path_factory.mktemp("reference")
    _finish(_static(workdir))
    return workdir


def test_static_form_restarts_resume_exactly(reference: Path, tmp_path: Path) -> None:
    # rank 1 dies after step 7 (checkpoints 3 and 6 durable); in the second attempt rank 0 dies
    # while checkpoint 9 is written, so the third attempt resumes from 6 again
    out = _finish(_static(tmp_path, "--die", "0:1:7:step,1:0:9:persist"))
    assert incarnations(out) == [(0, 0, 0), (0, 1, 0), (1, 0, 6), (1, 1, 6), (2, 0, 6), (2, 1, 6)]
    for final, expected in zip(final_states(tmp_path), final_states(reference), strict=True):
        assert_state_equal(final, expected)  # model, optimizer, scheduler, per-rank values, RNG
    assert_each_sample_once_per_epoch(tmp_path / "batches.log")


def _worker(workdir: Path, store_port: int, rank: int, attempt: int, *extra: str) -> subprocess.Popen[str]:
    """A worker as torchrun's static form starts it: a client of the agent's store (here the test's)."""
    env = {
        **ENV,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store_port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
    }
    return subprocess.Popen(
        [sys.executable, *_train_args(workdir, *extra)],
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def _outcomes(procs: list[subprocess.Popen[str]], timeout: float = 120) -> list[tuple[int | None, str]]:
    """(exit status, last lines of output) of each process; one still running after ``timeout`` is killed."""
    outcomes = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate()
        outcomes.append((proc.returncode, out[-3000:]))
    return outcomes


def test_checkfreq_groups_ignore_a_dead_attempts_keys(reference: Path, tmp_path: Path) -> None:
    """The restarted workers share the store with their killed predecessors and use it as it is.

    Only the default group's two rendezvous keys are removed between the attempts, so that the
    job's own ``init_process_group`` cannot read a dead address; every key checkfreq's groups
    (and, before, ``dist.new_group``) left stays where it was.
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    first = _outcomes([_worker(tmp_path, store.port, rank, 0, "--die", "0:1:7:step") for rank in (0, 1)])
    assert [code for code, _ in first] == [1, -9], first  # rank 1 kills itself; rank 0 fails in DDP's all-reduce
    default_group_keys = [f"default_pg/0//cpu//0/{rank}" for rank in (0, 1)]
    assert store.check(default_group_keys), "torch names the default group's keys differently now"
    for key in default_group_keys:
        store.delete_key(key)
    second = _outcomes([_worker(tmp_path, store.port, rank, 1) for rank in (0, 1)])
    assert [code for code, _ in second] == [0, 0], second
    assert incarnations("".join(out for _, out in second)) == [(1, 0, 6), (1, 1, 6)]
    for final, expected in zip(final_states(tmp_path), final_states(reference), strict=True):
        assert_state_equal(final, expected)
    assert_each_sample_once_per_epoch(tmp_path / "batches.log")


def test_the_token_is_fresh_whatever_earlier_processes_left_in_the_store() -> None:
    store, keys = dist.HashStore(), "checkfreq/groups/control"

    def agree() -> set[str]:
        with ThreadPoolExecutor(4) as pool:
            return set(pool.map(lambda r: agree_on_token(store, keys, r, 4, timedelta(seconds=10)), range(4)))

    earlier = agree()
    assert len(earlier) == 1
    store.append(f"{keys}/asks", "2:a-dead-rank's-nonce,")  # a rank killed after asking, before any answer
    store.set(f"{keys}/token", earlier.pop())  # what a protocol with one fixed key would read
    tokens = agree()
    assert len(tokens) == 1 and store.get(f"{keys}/token").decode() not in tokens


def test_a_missing_rank_is_named_after_the_timeout() -> None:
    store, keys, wait = dist.HashStore(), "checkfreq/groups/commit", timedelta(seconds=0.5)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(agree_on_token, store, keys, 0, 3, wait)
        agree_on_token(store, keys, 1, 3, wait)
        with pytest.raises(CheckfreqError, match=r"ranks \[2\] did not join"):
            first.result()
    with pytest.raises(CheckfreqError, match="rank 1 got no answer from rank 0 within"):
        agree_on_token(dist.HashStore(), keys, 1, 2, wait)
