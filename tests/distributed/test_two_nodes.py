"""Two "nodes" on one machine: node-local checkpoint directories and one shared remote tier.

Each test runs two torchrun agents (``--nnodes 2``, c10d rendezvous on 127.0.0.1, one rank per
agent, CPU, gloo) of ``scripts/ddp_train.py``; each agent ("node") gets its own local directory
and both share a remote tier: a real S3-protocol server on loopback, or a plain directory.
Ranks SIGKILL themselves at chosen points (hooks in the script), nodes lose their local disk
between runs, and every job must end bit-identical to one uninterrupted run, having used every
sample once per epoch.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from checkfreq.run.events import read_events
from checkfreq.storage import FsspecStore, LocalStore
from checkfreq.storage.format import MANIFEST_NAME
from checkfreq.storage.shm_paths import SHM_DIR_ENV
from helpers import (
    BATCH,
    EPOCHS,
    EVERY,
    SAMPLES,
    SCRIPTS,
    assert_each_sample_once_per_epoch,
    assert_state_equal,
    free_port,
    kill_tree,
)

# test_distributed's job (64 samples, batches of 8, 3 epochs, a checkpoint every 3 steps): at world
# size 2, 4 steps per epoch, 12 in all, checkpoints 3, 6, 9, 12
HALF, LAST = 6, 12  # HALF: where the first run of a job that is stopped and resumed elsewhere ends
RANKS = (0, 1)
TIMEOUT_S = 240  # a job takes 10 to 20 s


@dataclass
class Remote:
    """The shared remote tier of one job, as the script's options and as a store to inspect."""

    args: tuple[str, ...]
    url: str
    endpoint: str | None

    def steps(self) -> list[int]:
        """The checkpoints the remote tier lists (committed: their manifest exists), newest first."""
        if self.endpoint is None:
            return [step for step, _ in LocalStore(self.url, create=False).checkpoints()]
        store = FsspecStore(self.url, endpoint_url=self.endpoint, key="testing", secret="testing")
        store.fs.invalidate_cache()
        return [step for step, _ in store.checkpoints()]


@pytest.fixture(params=["s3", "directory"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> Remote:
    if request.param == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        url = f"s3://ckpt-{uuid.uuid4().hex[:12]}/job"
        return Remote(("--remote", url, "--endpoint", endpoint), url, endpoint)
    path = tmp_path / "remote"
    return Remote(("--remote", str(path)), str(path), None)


def run_nodes(
    work: Path,
    local_dirs: tuple[Path, Path],
    *extra: str,
    restarts: int = 0,
    expect_success: bool = True,
    per_node: int = 1,
    shm_dirs: tuple[Path, Path] | None = None,
) -> str:
    """One job of ``ddp_train.py`` on two torchrun agents of ``per_node`` ranks each, node ``i`` with
    ``local_dirs[i]`` (and, given ``shm_dirs``, its own shared memory ``shm_dirs[i]``: docs/reliability.md);
    its output."""
    port = free_port()
    # The c10d rendezvous ranks the agents by address (it ignores --node-rank): node i, at
    # 127.0.0.<i+1>, runs ranks i·per_node … (i+1)·per_node − 1 in every job and every restart.
    # As in test_distributed, the workers get their own store (pytorch/pytorch#135712, docs/distributed.md).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    procs, logs = [], [work / f"node{node}.log" for node in range(2)]
    for node, local_dir in enumerate(local_dirs):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            str(per_node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--local-addr",
            f"127.0.0.{node + 1}",
            "--max-restarts",
            str(restarts),
            "--monitor-interval",
            "0.1",
            str(SCRIPTS / "ddp_train.py"),
            "--ckpt-dir",
            str(local_dir),
            "--final",
            str(work / "final"),
            "--batch-log",
            str(work / "batches.log"),
            "--samples",
            str(SAMPLES),
            "--batch-size",
            str(BATCH),
            "--epochs",
            str(EPOCHS),
            "--every",
            str(EVERY),
            "--kill-marker",
            str(work / "killed"),
            *extra,
        ]
        node_env = env if shm_dirs is None else {**env, SHM_DIR_ENV: str(shm_dirs[node])}
        with open(logs[node], "w") as log:
            procs.append(
                subprocess.Popen(
                    command, cwd=work, stdout=log, stderr=subprocess.STDOUT, env=node_env, start_new_session=True
                )
            )
    deadline, hung = time.monotonic() + TIMEOUT_S, False
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        hung = True
    finally:
        for proc in procs:  # the workers of a torchrun agent run in sessions of their own
            kill_tree(proc.pid)
            proc.wait()
    outs = [log.read_text() for log in logs]
    out = "".join(f"---- node {node}\n{text}" for node, text in enumerate(outs))
    codes = [proc.returncode for proc in procs]
    assert not hung, f"the job hung: killed after {TIMEOUT_S} s\n{out[-8000:]}"
    assert (codes == [0, 0]) == expect_success, f"exit codes {codes}\n{out[-6000:]}"
    for node, text in enumerate(outs):
        assert set(restored(text)) <= set(range(node * per_node, (node + 1) * per_node)), (
            f"node {node} ran ranks {sorted(restored(text))}"
        )
    return out


def restored(out: str) -> dict[int, list[int]]:
    """The step each incarnation of each rank restored, in order."""
    steps: dict[int, list[int]] = {}
    for rank, step in re.findall(r"rank=(\d+) restored step=(\d+)", out):
        steps.setdefault(int(rank), []).append(int(step))
    return steps


def restore_tiers(local_dir: Path) -> dict[int, list[tuple[int, str]]]:
    """(step, tier) of every restore the ranks of a node logged, per rank."""
    tiers: dict[int, list[tuple[int, str]]] = {}
    for record in read_events(local_dir):
        if record["event"] == "restore":
            tiers.setdefault(record["rank"], []).append((record["step"], record["tier"]))
    return tiers


def assert_same_final_state(work: Path, reference: Path, ranks: tuple[int, ...] = RANKS) -> None:
    """Weights, BatchNorm buffers, optimizer, scheduler, RNG and per-rank values, rank by rank."""
    for rank in ranks:
        assert_state_equal(torch.load(work / f"final.rank{rank}.pt"), torch.load(reference / f"final.rank{rank}.pt"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted job at the same world size: its final state is every test's expectation
    (where checkpoints go does not change the training)."""
    work = tmp_path_factory.mktemp("reference")
    run_nodes(work, (work / "ckpt", work / "ckpt"))
    return work


def node_dirs(work: Path) -> tuple[Path, Path]:
    return work / "node0", work / "node1"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("remote", "shared_local"),
    [("s3", False), ("directory", True)],
    indirect=["remote"],
    ids=["s3-node-local", "directory-shared-local"],
)
def test_rank_killed_mid_persist_restarts_from_local_tier(
    reference: Path, remote: Remote, tmp_path: Path, shared_local: bool
) -> None:
    """Rank 1 dies half-way through writing its file of checkpoint 6; torchrun restarts both nodes,
    which resume from checkpoint 3 in their local tier (node-local directories, or one directory
    both nodes share)."""
    local_dirs = (tmp_path / "local",) * 2 if shared_local else node_dirs(tmp_path)
    out = run_nodes(tmp_path, local_dirs, *remote.args, "--wait-remote", "--kill-write", "1:2", restarts=1)
    assert (tmp_path / "killed").exists(), out[-4000:]  # the kill happened
    assert restored(out) == {0: [0, EVERY], 1: [0, EVERY]}, out[-4000:]
    if shared_local:  # every file of checkpoint 3 is in the shared directory
        assert restore_tiers(local_dirs[0]) == {0: [(EVERY, "local")], 1: [(EVERY, "local")]}
    else:  # each node holds its own rank's file and receives the other's from its rank, none from the remote tier
        assert [restore_tiers(d) for d in local_dirs] == [{0: [(EVERY, "local+peer")]}, {1: [(EVERY, "local+peer")]}]
    assert remote.steps()[0] == LAST  # close() waited for the last upload
    assert_same_final_state(tmp_path, reference)
    assert_each_sample_once_per_epoch(tmp_path / "batches.log")


@pytest.mark.slow
def test_replaced_node_resumes_from_remote_tier(reference: Path, remote: Remote, tmp_path: Path) -> None:
    """The job stops at step 6; node 1 is replaced (its local directory is gone); the next job
    resumes at step 6: the file only node 1 held from the remote tier (read once, by rank 1, which
    has no other file to read), node 0's from node 0."""
    node0, node1 = node_dirs(tmp_path)
    out = run_nodes(tmp_path, (node0, node1), *remote.args, "--stop-at", str(HALF))
    assert restored(out) == {0: [0], 1: [0]}
    assert remote.steps()[0] == HALF  # close() waited for the uploads
    shutil.rmtree(node1)
    out = run_nodes(tmp_path, (node0, node1), *remote.args)
    assert restored(out) == {0: [HALF], 1: [HALF]}, out[-4000:]
    # a fresh machine: node 0's file from it, its own remotely
    assert restore_tiers(node1) == {1: [(HALF, "peer+remote")]}
    assert restore_tiers(node0) == {0: [(HALF, "local+peer")]}  # its own file locally, node 1's pieces from rank 1
    assert_same_final_state(tmp_path, reference)
    assert_each_sample_once_per_epoch(tmp_path / "batches.log")


@pytest.mark.slow
def test_checkpoint_not_uploaded_by_every_rank_is_never_restored_from_remote(
    reference: Path, remote: Remote, tmp_path: Path
) -> None:
    """Rank 1 dies after checkpoint 6 is committed in the local tiers, before it uploads its file:
    the remote tier never lists 6, and a replaced cluster (both local directories gone) resumes
    from the newest checkpoint every rank uploaded."""
    killed_step = 2 * EVERY
    local_dirs = node_dirs(tmp_path)
    out = run_nodes(
        tmp_path, local_dirs, *remote.args, "--wait-remote", "--kill-upload", f"1:{killed_step}", expect_success=False
    )
    assert (tmp_path / "killed").exists(), out[-4000:]
    for local_dir in local_dirs:  # the kill came after the local commit
        assert (local_dir / f"step_{killed_step:09d}" / MANIFEST_NAME).exists(), sorted(os.listdir(local_dir))
    assert remote.steps() == [EVERY]  # checkpoint 6 is not listed: its manifest was never written
    for local_dir in local_dirs:
        shutil.rmtree(local_dir)
    out = run_nodes(tmp_path, local_dirs, *remote.args)
    assert restored(out) == {0: [EVERY], 1: [EVERY]}, out[-4000:]
    # each rank reads one of the two files from the remote tier and gets the other's pieces from its peer
    assert [restore_tiers(d) for d in local_dirs] == [{0: [(EVERY, "peer+remote")]}, {1: [(EVERY, "peer+remote")]}]
    assert_same_final_state(tmp_path, reference)
    assert_each_sample_once_per_epoch(tmp_path / "batches.log")


@pytest.mark.slow
def test_healthy_restarts_read_nothing_from_remote_tier(tmp_path: Path) -> None:
    """Two nodes of two ranks each (world size 4: 2 steps per epoch, 6 in all), every checkpoint
    uploaded. The job stops at step 2 and the remote tier loses every data file (its manifests
    stay); the next job, each rank on the same node, resumes at 2 from the nodes' directories (each
    node's own ranks' files locally, the other node's from its ranks) and stops at 4; the remote
    tier loses its data files again, and the last job runs each rank on the other node than before
    (the nodes' directories swapped, as c10d may place them), so each node holds only the other
    node's ranks' files: it resumes at 4 the same way. No rank reads the remote tier, and the job
    ends as one uninterrupted job (DDP with its defaults: the restores give it its rebuilt gradient
    buckets back, docs/exactness.md)."""
    ranks = (0, 1, 2, 3)
    reference, work, remote = tmp_path / "reference", tmp_path / "work", tmp_path / "remote"
    reference.mkdir()
    run_nodes(reference, (reference / "ckpt",) * 2, per_node=2)
    work.mkdir()
    node0, node1 = node_dirs(work)
    for placement, resumed, stop in (((node0, node1), 0, 2), ((node0, node1), 2, 4), ((node1, node0), 4, None)):
        until = () if stop is None else ("--stop-at", str(stop))
        out = run_nodes(work, placement, "--remote", str(remote), *until, per_node=2)
        assert restored(out) == {rank: [resumed] for rank in ranks}, out[-4000:]
        if resumed:  # a node's events hold the restores of every rank that ran there
            tiers = [
                (rank, entry)
                for node in (node0, node1)
                for rank, entries in restore_tiers(node).items()
                for entry in entries
                if entry[0] == resumed
            ]
            assert sorted(tiers) == [(rank, (resumed, "local+peer")) for rank in ranks], tiers
        if stop is not None:
            assert [step for step, _ in LocalStore(str(remote), create=False).checkpoints()][0] == stop
            data = list(remote.glob("step_*/*.safetensors"))
            assert data
            for path in data:
                path.unlink()
    assert_same_final_state(work, reference, ranks)
    assert_each_sample_once_per_epoch(work / "batches.log")


@pytest.mark.slow
def test_each_node_keeps_one_copy_in_its_memory_and_every_rank_resumes_from_it(tmp_path: Path) -> None:
    """Two nodes of two ranks each, each node with its own shared memory (``CHECKFREQ_SHM_DIR`` per
    agent) and local directory, a memory snapshot every step and no persist before the end: each
    node's two ranks keep one copy of the replicated state between them, and when rank 3 is killed
    after step 3, every rank of both nodes resumes from its node's memory, bit-identical."""
    ranks = (0, 1, 2, 3)
    reference, work = tmp_path / "reference", tmp_path / "work"
    reference.mkdir()
    run_nodes(reference, (reference / "ckpt",) * 2, per_node=2)
    work.mkdir()
    shm_dirs = (
        Path("/dev/shm") / f"checkfreq-test-{uuid.uuid4().hex[:8]}-a",
        Path("/dev/shm") / f"checkfreq-test-{uuid.uuid4().hex[:8]}-b",
    )
    for path in shm_dirs:
        path.mkdir()
    try:
        out = run_nodes(
            work,
            node_dirs(work),
            "--every",
            "100",
            "--memory",
            "1",
            "--die",
            "0:3:3:step",
            per_node=2,
            restarts=1,
            shm_dirs=shm_dirs,
        )
        resumed = {steps[1] for steps in restored(out).values()}
        assert resumed <= {2, 3} and len(resumed) == 1, out[-4000:]
        for node, local in enumerate(node_dirs(work)):
            tiers = restore_tiers(local)
            assert sorted(tiers) == [2 * node, 2 * node + 1], tiers
            assert all(entries[-1][1] == "memory" for entries in tiers.values()), tiers
            by_step: dict[int, dict[int, int]] = {}
            for record in read_events(local):
                if record["event"] == "memory":
                    by_step.setdefault(record["step"], {})[record["rank"]] = record["bytes"]
            pairs = [sorted(b.values()) for b in by_step.values() if len(b) == 2]
            assert pairs and all(abs(a - b) < 0.2 * (a + b) for a, b in pairs), pairs  # each about half
        assert_same_final_state(work, reference, ranks)
        assert_each_sample_once_per_epoch(work / "batches.log")
        assert not any(any(path.iterdir()) for path in shm_dirs)  # a clean close removes the regions
    finally:
        for path in shm_dirs:
            shutil.rmtree(path, ignore_errors=True)
