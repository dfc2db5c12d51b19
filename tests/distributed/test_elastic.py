"""Resizing a DDP job keeps it on course: the same global batch at every optimizer step.

A job of ``scripts/elastic_train.py`` (96 samples, global batches of 16, 2 epochs: 12 optimizer
steps, a checkpoint every 2) runs uninterrupted at world size 4, and again killed at 4, resumed at
2 (and 1) and finished at 4; and under torchrun's elastic launch (``--nnodes 1:2``) on two agents,
one of them killed for good, then a new one joining. Every step must take the samples the
uninterrupted run took, each sample once per epoch, and the result must equal the uninterrupted
run's up to the order of the floating-point sums (``TOLERANCE``). A Lightning DDP fit and a Hugging
Face Trainer run resumed on one process must take the same global batches, or be refused.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from elastic_train import command, read_steps, step_samples

from checkfreq.run.events import read_events
from checkfreq.storage.shm_paths import SHM_DIR_ENV
from checkfreq.tools.report import load_run, summary_text
from helpers import SCRIPTS, free_port, hf_fit, kill_tree, run_job, sample_reads

SAMPLES, GLOBAL_BATCH, EPOCHS = 96, 16, 2
STEPS = SAMPLES // GLOBAL_BATCH * EPOCHS
# The gradient of a step is the same mean over the same 16 samples at every world size, but summed
# in another order (per rank, then DDP's average over ranks, then over micro-batches): float32
# results differ in the last bits, and AdamW carries that over 12 steps. Measured: at most 3e-8 on
# parameters of magnitude 0.1 to 0.4 (a few units in the last place); the bound leaves room for
# other CPUs' summation kernels while failing on any other batch composition (which moves the
# parameters by 1e-3 or more).
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def launch(work: Path, nproc: int, log: str, *extra: str, expect_success: bool = True) -> str:
    """One job of elastic_train.py on ``nproc`` ranks under torchrun (0: one plain process); its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    code, out = run_job(
        command(
            nproc,
            "--ckpt-dir",
            str(work / "ckpt"),
            "--final",
            str(work / "final.pt"),
            "--step-log",
            str(work / log),
            "--samples",
            str(SAMPLES),
            "--global-batch",
            str(GLOBAL_BATCH),
            "--epochs",
            str(EPOCHS),
            *extra,
        ),
        env,
        timeout=240,
    )
    assert (code == 0) == expect_success, out[-4000:]
    return out


def assert_on_course(steps: dict, reference: Path, final: Path) -> None:
    """Every step took the uninterrupted run's samples, each once per epoch; the result equals its result."""
    expected = read_steps(reference / "steps.log")
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert step_samples(steps) == step_samples(expected)  # exact: the same samples at every step
    per_epoch = SAMPLES // GLOBAL_BATCH
    for epoch in range(EPOCHS):
        seen = Counter(
            i for step in range(epoch * per_epoch + 1, (epoch + 1) * per_epoch + 1) for i in step_samples(steps)[step]
        )
        assert sorted(seen) == list(range(SAMPLES)) and set(seen.values()) == {1}, epoch
    losses = torch.tensor([steps[s][0][0] for s in sorted(steps)], dtype=torch.float64)
    torch.testing.assert_close(
        losses, torch.tensor([expected[s][0][0] for s in sorted(steps)], dtype=torch.float64), **TOLERANCE
    )
    final_state, uninterrupted = torch.load(final), torch.load(reference / "final.pt")
    assert final_state["scheduler"] == uninterrupted["scheduler"]  # the schedule counted the same optimizer steps
    torch.testing.assert_close(final_state["model"], uninterrupted["model"], **TOLERANCE)
    torch.testing.assert_close(final_state["optimizer"]["state"], uninterrupted["optimizer"]["state"], **TOLERANCE)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("uninterrupted")
    launch(work, 4, "steps.log")
    return work


@pytest.mark.slow
def test_a_resized_job_takes_the_uninterrupted_runs_global_batches(reference: Path, tmp_path: Path) -> None:
    """Killed at 4 ranks after step 5 (restored at 4), resumed on 2 ranks (each a batch of 8 a
    step), then in one process with ``--micro 4`` (at most 4 samples per batch: 4 micro-batches a
    step), finished at 4 again."""
    resizes = ((2, 7, ()), (0, 10, ("--micro", "4")))
    launch(tmp_path, 4, "run0.log", "--die", "0:5", expect_success=False)
    restored = [4]
    for number, (nproc, stop, extra) in enumerate(resizes, start=1):
        out = launch(tmp_path, nproc, f"run{number}.log", "--stop-at", str(stop), *extra)
        accumulation = GLOBAL_BATCH // max(nproc, 1) // 4 if extra else 1
        assert out.count(f"restored step={restored[-1]} accumulation={accumulation}") == max(nproc, 1), out[-3000:]
        restored.append(stop)
    out = launch(tmp_path, 4, "last.log")
    assert out.count(f"world=4 restored step={restored[-1]} accumulation=1") == 4

    logs = [tmp_path / f"run{n}.log" for n in range(len(resizes) + 1)] + [tmp_path / "last.log"]
    steps = read_steps(*logs)
    worlds = {step: {world for _, _, world in ranks.values()} for step, ranks in steps.items()}
    assert worlds[5] == {2} and worlds[STEPS] == {4}  # step 5 was run again on 2 ranks after the kill
    assert_on_course(steps, reference, tmp_path / "final.pt")
    text = summary_text(load_run(tmp_path / "ckpt"))  # the report shows each resize
    sizes = [*(max(nproc, 1) for nproc, _, _ in resizes), 4]
    for restored_step, (saved, now) in zip(restored, zip([4, *sizes], sizes, strict=False), strict=True):
        assert f"restored step {restored_step} on {now} rank(s), saved by {saved} " in text, text


def elastic_agent(
    work: Path, node: int, local_dir: str, port: int, *extra: str, nproc: int = 1, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """A torchrun agent of an elastic job (1 to 2 nodes of ``nproc`` ranks) on 127.0.0.<node+1>; by
    default, with ``--kill-node 5 --die 1:7 --pause-at 1:9``.

    Node 0 hosts the rendezvous store (``is_host``): the store must outlive the node that is lost.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})}
    torchrun = command(
        nproc,
        "--ckpt-dir",
        str(work / local_dir),
        "--remote",
        str(work / "remote"),
        "--final",
        str(work / "final.pt"),
        "--step-log",
        str(work / "steps.log"),
        "--samples",
        str(SAMPLES),
        "--global-batch",
        str(GLOBAL_BATCH),
        "--epochs",
        str(EPOCHS),
        *(extra or ("--kill-node", "5", "--die", "1:7", "--pause-at", "1:9")),
    )
    at = torchrun.index("--standalone")
    torchrun[at : at + 1] = [
        "--nnodes",
        "1:2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--local-addr",
        f"127.0.0.{node + 1}",
        "--rdzv-conf",
        f"last_call_timeout=1,is_host={int(node == 0)}",
    ]
    torchrun[torchrun.index("--max-restarts=0")] = "--max-restarts=3"
    log = (work / f"{local_dir}.out").open("w")
    return subprocess.Popen(torchrun, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


@pytest.mark.slow
def test_torchrun_elastic_job_loses_a_node_and_gets_one_back_on_course(reference: Path, tmp_path: Path) -> None:
    """``--nnodes 1:2``: node 1 is killed for good after step 5 (its agent and its worker); the
    survivor's worker restarts alone and goes on from checkpoint 4 (node 1's half of it from the
    remote tier); killed again after step 7, it resumes at world size 1 from checkpoint 6; after
    step 9 a new node 1 with an empty local directory joins and torchrun restarts both at world
    size 2 from checkpoint 8, which finish the job."""
    port, agents = free_port(), []
    try:
        agents += [elastic_agent(tmp_path, node, f"node{node}", port) for node in (0, 1)]
        paused, deadline = tmp_path / "steps.log.paused", time.monotonic() + 150
        while not paused.exists():
            assert time.monotonic() < deadline and agents[0].poll() is None, (tmp_path / "node0.out").read_text()[
                -4000:
            ]
            time.sleep(0.2)
        agents.append(elastic_agent(tmp_path, 1, "node1-new", port))
        codes = [agent.wait(timeout=150) for agent in agents]
    finally:
        for agent in agents:  # the workers of a torchrun agent run in sessions of their own
            kill_tree(agent.pid)
    outs = {name: (tmp_path / f"{name}.out").read_text() for name in ("node0", "node1", "node1-new")}
    assert codes == [0, -9, 0], outs
    restores = [
        line.split(" accumulation")[0] for out in outs.values() for line in out.splitlines() if "restored step=" in line
    ]
    assert restores == [
        "life=0 rank=0 world=2 restored step=0",
        "life=1 rank=0 world=1 restored step=4",
        "life=2 rank=0 world=1 restored step=6",
        "life=2 rank=0 world=2 restored step=8",
        "life=0 rank=1 world=2 restored step=0",
        "life=0 rank=1 world=2 restored step=8",
    ], outs

    lines = [line.split() for line in (tmp_path / "steps.log").read_text().splitlines()]
    seventh = {line[0]: line[5:7] for line in lines if line[1] == "7"}
    assert seventh["1"] == seventh["2"]  # resumed at the same size: step 7's loss and parameters again, bit for bit
    steps = read_steps(tmp_path / "steps.log")
    worlds = [sorted({world for _, _, world in steps[step].values()}) for step in sorted(steps)]
    assert worlds == [[2]] * 4 + [[1]] * 4 + [[2]] * 4  # step 9 was run again after the new node joined
    assert_on_course(steps, reference, tmp_path / "final.pt")


@pytest.mark.slow
def test_a_node_lost_for_good_resumes_from_the_survivors_memory(reference: Path, tmp_path: Path) -> None:
    """``--nnodes 1:2``, two ranks per node, each node with its own shared memory and a memory snapshot
    every step: node 1 is lost for good after step 5, its memory and local directory with it; node 0's
    ranks restart at world size 2 from step 5 in their memory (the durable checkpoint is step 4),
    put together from the shares they took at world size 4, and finish on course."""
    port, shm = free_port(), [tmp_path / "shm0", tmp_path / "shm1"]
    for path in shm:
        path.mkdir()
    agents = [
        elastic_agent(
            tmp_path,
            node,
            f"node{node}",
            port,
            "--memory",
            "1",
            "--kill-node",
            "5",
            nproc=2,
            env={SHM_DIR_ENV: str(shm[node])},
        )
        for node in (0, 1)
    ]
    try:
        codes = [agent.wait(timeout=200) for agent in agents]
    finally:
        for agent in agents:
            kill_tree(agent.pid)
    outs = {node: (tmp_path / f"node{node}.out").read_text() for node in (0, 1)}
    assert codes == [0, -9], outs
    restores = sorted(re.findall(r"life=\d+ rank=\d+ world=\d+ restored step=\d+", outs[0]))
    assert restores == [
        "life=0 rank=0 world=4 restored step=0",
        "life=0 rank=1 world=4 restored step=0",
        "life=1 rank=0 world=2 restored step=5",
        "life=1 rank=1 world=2 restored step=5",
    ], outs
    tiers = {
        (e["rank"], e["tier"], e["saved_world_size"])
        for e in read_events(tmp_path / "node0")
        if e["event"] == "restore"
    }
    assert tiers == {(0, "memory", 4), (1, "memory", 4)}, tiers  # the shares were taken at world size 4
    assert_on_course(read_steps(tmp_path / "steps.log"), reference, tmp_path / "final.pt")


def fit_lightning(work: Path, log: str, *args: str, expect_success: bool = True) -> str:
    code, out = run_job(
        [
            sys.executable,
            str(SCRIPTS / "lightning_resize.py"),
            "--dir",
            str(work / "ckpt"),
            "--log",
            str(work / log),
            *args,
        ],
        {**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=240,
    )
    assert (code == 0) == expect_success, out[-4000:]
    return out


def lightning_steps(*logs: Path) -> dict[int, list[int]]:
    """Step -> the sorted sample ids of its batches on all ranks; a later log's step replaces an earlier one's."""
    steps: dict[int, list[int]] = {}
    for log in logs:
        this: dict[int, list[int]] = {}
        for line in log.read_text().splitlines():
            step, _, *ids = map(int, line.split())
            this.setdefault(step, []).extend(ids)
        steps.update({step: sorted(ids) for step, ids in this.items()})
    return steps


@pytest.mark.slow
def test_lightning_ddp_fit_resumed_on_one_device_keeps_the_global_batches(tmp_path: Path) -> None:
    """A global batch of 8 over 2 devices (DDP), the fit killed after step 4 (restored at 3), resumed
    on 1 device: the steps of an uninterrupted fit. Resuming mid-epoch with 2 batches per step
    instead of 1 is refused before any step (Lightning counts the epoch's batches, not steps). The
    ranks' epoch sums of a logged metric cannot all come back to one rank: they start afresh, with a warning."""
    pytest.importorskip("lightning")
    fit_lightning(tmp_path / "reference", "steps.log")
    fit_lightning(tmp_path, "run0.log", "--devices", "2", "--die-at", "4", expect_success=False)
    out = fit_lightning(tmp_path, "refused.log", "--micro", "4", "--accumulate", "2", expect_success=False)
    assert "restored fit counts 3 batches into epoch 0, which is not 3 optimizer steps of 2 batches" in out
    assert not (tmp_path / "refused.log").exists()
    out = fit_lightning(tmp_path, "run1.log", "--micro", "4", expect_success=False)
    assert "pass accumulate_grad_batches=2" in out
    out = fit_lightning(tmp_path, "run1.log")
    assert "rank 0 restored 3 final 18" in out
    assert "taken on 2 rank(s) in the middle of an epoch, this fit runs on 1" in out  # the epoch sums of train_loss
    assert "the epoch values of train_loss start afresh" in out
    steps = lightning_steps(tmp_path / "run0.log", tmp_path / "run1.log")
    assert steps == lightning_steps(tmp_path / "reference" / "steps.log")
    assert len(steps) == 18 and all(len(ids) == 8 for ids in steps.values())


@pytest.mark.slow
def test_hf_trainer_resumed_on_one_process_keeps_the_global_batches(tmp_path: Path) -> None:
    """2 processes x 4 samples x 2 accumulated batches, killed after step 4 (restored at 3), resumed
    in one process with 4 accumulated batches: every step takes the samples of an uninterrupted
    one-process run. Resuming with 2 accumulated batches (8 samples a step) is refused before any step."""
    pytest.importorskip("transformers")

    reference, run = tmp_path / "reference", tmp_path / "run"
    hf_fit(reference, "final", "--grad-acc", "4")
    hf_fit(run, "killed", "--die-at", "4", killed=True, ranks=2)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    code, out = run_job(
        [
            sys.executable,
            str(SCRIPTS / "hf_train.py"),
            "--dir",
            str(run),
            "--out",
            str(run / "refused.pt"),
            "--read-log",
            str(run / "refused.log"),
            "--resume_from_checkpoint",
            "true",
        ],
        env,
    )
    assert code != 0 and "the checkpoint's optimizer steps took 16 samples each" in out and "this run's take 8" in out
    assert not (run / "refused.log").exists()  # refused before reading a sample
    assert "restored 3 final 6" in hf_fit(run, "final", "--grad-acc", "4")

    ranks = [sample_reads(run / f"killed.log.{rank}") for rank in (0, 1)]  # 8 reads per step on each rank
    steps = [sorted(ranks[0][8 * s : 8 * s + 8] + ranks[1][8 * s : 8 * s + 8]) for s in range(3)]
    resumed, expected = sample_reads(run / "final.log"), sample_reads(reference / "final.log")
    steps += [sorted(resumed[16 * s : 16 * s + 16]) for s in range(3)]
    assert steps == [sorted(expected[16 * s : 16 * s + 16]) for s in range(6)] and len(expected) == 96
