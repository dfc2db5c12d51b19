"""The fault matrix: a rank, or a whole torchrun agent, lost at each phase; the job never hangs.

Each job runs ``scripts/fault_train.py`` on two torchrun agents of two ranks each (gloo, c10d
rendezvous on 127.0.0.1, node 0 hosting it; each agent with its own node-local directory and a
shared remote tier), with ``--nnodes 2`` or ``--nnodes 1:2``. The script SIGKILLs a rank, or its
agent and the agent's workers (a node lost), or SIGSTOPs the agent and its workers (a node that
vanished without closing its connections), at a named phase. The harness watches the processes:
every worker alive at the kill must be gone within the failure timeout plus :data:`MARGIN_S`, the
job must restart and end bit-identical to an uninterrupted run at the same size (a lost agent is
replaced with ``--nnodes 2``) or on course at the smaller size (``--nnodes 1:2``: the same global
batch at every step), and a survivor's error must name a lost rank with its host and pid.

By default (about a minute on the 2-core test machine, with the one-process run the jobs are
compared with) two jobs run: a node of two ranks SIGKILLed for good in a commit, with the default
options, and a frozen node (the heartbeats find it); two spawned ranks test a ``with`` block left on
an error, and three a rank gone before a gather to it is posted. ``CHECKFREQ_FAULT_MATRIX=ci`` (a
step of .ci/run, after the suite) runs each phase once, the kinds of fault and the launch forms
taken in turn, a node lost in a restore's exchange, a node killed as it sends a memory copy
(``replicas=1``, ``--nnodes 1:2``) and one frozen as it keeps one (``--nnodes 2``): 9 jobs and the
FSDP job's uninterrupted run, about 4 minutes. ``CHECKFREQ_FAULT_MATRIX=1`` runs every phase with
the three kinds of fault and both launch forms, a fault in a restore's exchange, and a node killed
or frozen mid-copy as the sender and as the keeper, with both launch forms: 47 jobs, about 26
minutes (docs/reliability.md has the table of measured times).

The replica cases run ``scripts/fsdp_memory.py`` instead (FSDP2, a memory snapshot at every step,
each copied to the other node, each agent its own ``CHECKFREQ_SHM_DIR``): the state no other rank
holds, so a copy is always in flight to be cut.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
from elastic_train import read_steps, step_samples
from fault_train import STACKS_SIGNAL
from fsdp_memory import read_losses
from worker_exit import exit_without_teardown

import checkfreq as cf
from checkfreq.ranks.collectives import GroupPeers
from checkfreq.ranks.compat import default_store
from checkfreq.ranks.groups import new_gloo_groups
from checkfreq.ranks.liveness import Liveness
from checkfreq.storage.shm_paths import SHM_DIR_ENV
from helpers import SCRIPTS, assert_state_equal, free_port, kill_tree, spawn_ranks

SAMPLES, GLOBAL_BATCH, EPOCHS, EVERY = 96, 16, 2, 2
STEPS = SAMPLES // GLOBAL_BATCH * EPOCHS  # 12: checkpoints at 2, 4, ... (a step later where the vote delays them)
FAILURE_TIMEOUT_S = 3.0
MARGIN_S = 12.0
"""Beyond the failure timeout, for a survivor to notice, leave and be reaped on two busy cores."""
JOB_TIMEOUT_S = 240
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}  # test_elastic's: the same global batches summed in another order
MODE = os.environ.get("CHECKFREQ_FAULT_MATRIX", "")
"""``1``: the whole matrix; ``ci``: a phase each, the kinds of fault and launch forms in turn (.ci/run)."""
FULL, ROTATION = MODE == "1", MODE == "ci"


@dataclass
class Fault:
    """One kill the script made (its marker), and what the harness saw after it."""

    record: dict
    exited_s: float | None = None
    """Seconds from the kill until every worker alive at the kill had exited."""
    restarted_s: float | None = None
    """Seconds from the kill until a worker of the next incarnation had restored."""


@dataclass
class Job:
    out: dict[str, str]
    codes: list[int | None]
    faults: list[Fault] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(f"---- {name}\n{text}" for name, text in self.out.items())

    @property
    def tails(self) -> str:
        """The end of every agent's output (a failed assertion's message)."""
        return "".join(f"---- {name}\n{text[-3000:]}" for name, text in self.out.items())


def agent(
    work: Path,
    node: int,
    port: int,
    nnodes: str,
    name: str,
    *args: str,
    directory: str | None = None,
    fsdp: bool = False,
) -> subprocess.Popen[str]:
    """A torchrun agent of two ranks on 127.0.0.<node+1> (node 0 hosts the rendezvous: it must outlive
    node 1), its local directory ``work/directory`` (``node<node>`` if None); with ``fsdp``, of
    ``fsdp_memory.py`` (:data:`FSDP_ARGS`), the shared memory of its own ``work/shm-<directory>``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    local = work / (directory or f"node{node}")
    if fsdp:
        script = [str(SCRIPTS / "fsdp_memory.py"), "--final", str(work / "final"), *FSDP_ARGS]
        env[SHM_DIR_ENV] = str(work / f"shm-{local.name}")
        Path(env[SHM_DIR_ENV]).mkdir(exist_ok=True)
    else:
        script = [
            str(SCRIPTS / "fault_train.py"),
            "--final",
            str(work / "final.pt"),
            "--samples",
            str(SAMPLES),
            "--global-batch",
            str(GLOBAL_BATCH),
            "--epochs",
            str(EPOCHS),
            "--every",
            str(EVERY),
        ]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--local-addr",
        f"127.0.0.{node + 1}",
        "--rdzv-conf",
        f"last_call_timeout=1,is_host={int(node == 0)}",
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.1",
        *script,
        "--ckpt-dir",
        str(local),
        "--remote",
        str(work / "remote"),
        "--step-log",
        str(work / "steps.log"),
        "--markers",
        str(work),
        *args,
    ]
    log = (work / f"{name}.out").open("w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, text=True)


def workers(agents: list[subprocess.Popen[str]], before: float) -> set[int]:
    """The pids of the agents' workers started before ``before`` (time.time())."""
    pids = set()
    for proc in agents:
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for child in children:
            try:
                if child.create_time() < before:
                    pids.add(child.pid)
            except psutil.NoSuchProcess:
                pass
    return pids


def alive(pids: set[int]) -> set[int]:
    living = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                living.add(pid)
        except psutil.NoSuchProcess:
            pass
    return living


def print_stacks(pids: set[int]) -> None:
    """Say which processes outlived a fault (the test's output), and have each print every thread's
    stack into its agent's output (fault_train.py registers the signal; a process that is not a
    worker of the script would end on it)."""
    for pid in pids:
        try:
            process = psutil.Process(pid)
            print(f"hung: pid {pid} ({process.status()}, parent {process.ppid()}): {' '.join(process.cmdline())[:300]}")
            os.kill(pid, STACKS_SIGNAL)
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass
    time.sleep(1.0)


def run_job(
    work: Path,
    nnodes: str,
    faults: str,
    *extra: str,
    replace_lost_agent: bool = False,
    fsdp: bool = False,
    new_machine: bool = False,
) -> Job:
    """One job with ``faults`` (fault_train.py's ``--faults``; with ``fsdp``, of ``fsdp_memory.py``),
    watched; node 1's agent is started again after it is lost when ``replace_lost_agent``: on a new
    machine, with an empty directory and empty shared memory, when the node is frozen (it still
    holds its directory's lock) or ``new_machine``, else on the same one."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    first = min((int(f.split(":")[2]) for f in faults.split(",") if int(f.split(":")[2])), default=0)
    args = ("--faults", faults, "--wait-remote-before", str(first), *extra)
    agents = [agent(work, node, port, nnodes, f"node{node}", *args, fsdp=fsdp) for node in (0, 1)]
    names = ["node0", "node1"]
    seen: list[Fault] = []
    watched: list[tuple[Fault, set[int]]] = []
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        lost = {pid for fault in seen for pid in fault.record["pids"]}  # a frozen agent never exits
        while any(a.poll() is None and a.pid not in lost for a in agents) and time.monotonic() < deadline:
            marker = work / f"fault{len(seen)}"
            if marker.exists():
                fault = Fault(json.loads(marker.read_text()))
                seen.append(fault)
                lost |= set(fault.record["pids"])
                watched.append((fault, workers(agents, fault.record["time"]) - set(fault.record["pids"])))
                if fault.record["what"] != "rank" and replace_lost_agent:  # a frozen node is replaced by a new machine
                    fresh = "node1-new" if fault.record["what"] == "freeze" or new_machine else None
                    agents.append(
                        agent(work, 1, port, nnodes, f"node1-{len(agents)}", *args, directory=fresh, fsdp=fsdp)
                    )
                    names.append(f"node1-{len(agents) - 1}")
            for fault, pids in list(watched):
                if not alive(pids):
                    fault.exited_s = time.time() - fault.record["time"]
                    watched.remove((fault, pids))
                elif time.time() - fault.record["time"] > FAILURE_TIMEOUT_S + 3 * MARGIN_S:
                    watched.remove((fault, pids))  # hung: exited_s stays None
                    print_stacks(alive(pids))
            time.sleep(0.1)
    finally:
        for proc in agents:  # the workers of a torchrun agent run in sessions of their own
            kill_tree(proc.pid)
            proc.wait()
    out = {name: (work / f"{name}.out").read_text() for name in names}
    job = Job(out, [a.returncode for a in agents], seen)
    restores = [float(at) for at in re.findall(r"restored step=\d+ at=([\d.]+)", job.text)]
    for fault in seen:
        later = [at - fault.record["time"] for at in restores if at > fault.record["time"]]
        fault.restarted_s = min(later, default=None)
        exited = "hung" if fault.exited_s is None else f"{fault.exited_s:.1f} s"
        restarted = "never" if fault.restarted_s is None else f"{fault.restarted_s:.1f} s"
        print(
            f"--nnodes {nnodes}, {fault.record['what']} of rank {fault.record['rank']} lost at "
            f"{fault.record['phase']} (step {fault.record['step']}): survivors gone after {exited}, "
            f"restored after {restarted}"
        )  # the table of docs/reliability.md (pytest -s)
    return job


def uninterrupted(work: Path, nproc: int) -> Path:
    """The job uninterrupted on ``nproc`` ranks under one agent (0: one plain process)."""
    script = [
        str(SCRIPTS / "fault_train.py"),
        "--ckpt-dir",
        str(work / "ckpt"),
        "--final",
        str(work / "final.pt"),
        "--step-log",
        str(work / "steps.log"),
        "--markers",
        str(work),
        "--samples",
        str(SAMPLES),
        "--global-batch",
        str(GLOBAL_BATCH),
        "--epochs",
        str(EPOCHS),
        "--every",
        str(EVERY),
    ]
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "--monitor-interval", "0.1"]
        if nproc
        else []
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    done = subprocess.run(
        [sys.executable, *launcher, *script], capture_output=True, text=True, env=env, timeout=JOB_TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return work


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What a job on course ends with (the same global batches; sums in another order): one process."""
    return uninterrupted(tmp_path_factory.mktemp("one-process"), 0)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What a job resumed at 4 ranks ends with, bit for bit (where the ranks run does not change the training)."""
    return uninterrupted(tmp_path_factory.mktemp("four-ranks"), 4)


def assert_survived(job: Job, failure_timeout: float, count: int = 1, *, named: bool = True) -> None:
    """Every fault made, no worker outlived it by more than the failure timeout plus the margin, and
    (``named``) a survivor named a lost rank, with its host and pid. A rank killed under a living
    agent may be named by that agent alone: when the survivors' DDP all-reduce fails before any wait
    of checkfreq's on it (always between checkpoints; in a commit's phase when training runs ahead of
    the writer), their agents stop them within a second, before a heartbeat could fall silent."""
    assert len(job.faults) == count, job.tails
    for fault in job.faults:
        record = fault.record
        assert fault.exited_s is not None and fault.exited_s < failure_timeout + MARGIN_S, (record, job.tails)
        assert fault.restarted_s is not None, (record, job.tails)
        if not named:
            continue
        host = socket.gethostname()
        named = [f"rank {rank} ({host}, pid " for rank in record["ranks"]]
        if record["what"] == "rank":
            named += [
                f"failed (exitcode: -9) local_rank: {rank % 2} (pid: {pid})"
                for rank, pid in zip(record["ranks"], record["pids"], strict=True)
            ]
        assert any(name in job.text for name in named), (record, job.text[-8000:])
    lost = [1] if any(f.record["what"] != "rank" for f in job.faults) else []  # node 1's first agent
    assert all(code == 0 for number, code in enumerate(job.codes) if number not in lost), (job.codes, job.tails)


def assert_bit_identical(work: Path, reference: Path) -> None:
    final, expected = torch.load(work / "final.pt"), torch.load(reference / "final.pt")
    assert final["scheduler"] == expected["scheduler"]
    for part in ("model", "optimizer"):
        torch.testing.assert_close(final[part], expected[part], rtol=0, atol=0)


def assert_replays_identical(work: Path) -> None:
    """A step run again after a restart at the same world size took the same loss to the same
    parameters, bit for bit (the resumed state was exact)."""
    runs: dict[tuple[str, str, str], set[tuple[str, str]]] = {}
    for line in (work / "steps.log").read_text().splitlines():
        _, step, rank, world, _, loss, fingerprint, *_ = line.split()
        runs.setdefault((step, rank, world), set()).add((loss, fingerprint))
    assert all(len(seen) == 1 for seen in runs.values()), {key: seen for key, seen in runs.items() if len(seen) > 1}


def assert_on_course(work: Path, reference: Path) -> None:
    """Every step took the uninterrupted job's samples, each once per epoch; the result equals its
    result up to the order of the sums."""
    steps, expected = read_steps(work / "steps.log"), read_steps(reference / "steps.log")
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert step_samples(steps) == step_samples(expected)
    per_epoch = SAMPLES // GLOBAL_BATCH
    for epoch in range(EPOCHS):
        seen = Counter(
            i for step in range(epoch * per_epoch + 1, (epoch + 1) * per_epoch + 1) for i in step_samples(steps)[step]
        )
        assert sorted(seen) == list(range(SAMPLES)) and set(seen.values()) == {1}, epoch
    final, uninterrupted = torch.load(work / "final.pt"), torch.load(reference / "final.pt")
    torch.testing.assert_close(final["model"], uninterrupted["model"], **TOLERANCE)


@pytest.mark.slow
def test_a_lost_node_of_two_ranks_restarts_the_survivors_within_a_minute_with_the_defaults(
    one_process: Path, tmp_path: Path
) -> None:
    """``--nnodes 1:2``, default options (failure_timeout 30 s): node 1 (ranks 2 and 3, and its agent)
    is lost for good in the commit of checkpoint 4, as rank 3 sends its report. The survivors leave
    and restart within 60 s of the loss, at 2 ranks, and finish on course."""
    job = run_job(tmp_path, "1:2", "gather:3:4:agent")
    assert_survived(job, 30.0)
    assert job.faults[0].restarted_s is not None and job.faults[0].restarted_s < 60, job.faults
    assert_on_course(tmp_path, one_process)


PHASES = ("between", "snapshot", "gather", "broadcast", "upload", "vote")
KINDS, FORMS = ("rank", "agent", "freeze"), ("2", "1:2")
CHEAP = [("broadcast", "freeze", "1:2")]
MATRIX = [(phase, what, nnodes) for phase in PHASES for what in KINDS for nnodes in FORMS]
ONE_A_PHASE = [(phase, KINDS[i % 3], FORMS[i % 2]) for i, phase in enumerate(PHASES)]


@pytest.mark.slow
@pytest.mark.parametrize(("phase", "what", "nnodes"), MATRIX if FULL else ONE_A_PHASE if ROTATION else CHEAP)
def test_a_rank_or_node_lost_at_a_phase_never_hangs_the_job(
    request: pytest.FixtureRequest, one_process: Path, tmp_path: Path, phase: str, what: str, nnodes: str
) -> None:
    """Rank 3 (or node 1: ranks 2 and 3) lost at ``phase`` of step 4's checkpoint (or after step 5,
    between checkpoints); a lost node comes back with ``--nnodes 2`` (the job resumes at 4 ranks,
    bit-identical) and stays lost with ``--nnodes 1:2`` (it resumes at 2 ranks, on course)."""
    rank = "2" if phase == "broadcast" and what == "rank" else "3"
    step = "5" if phase == "between" else "4"
    job = run_job(
        tmp_path,
        nnodes,
        f"{phase}:{rank}:{step}:{what}",
        "--failure-timeout",
        str(FAILURE_TIMEOUT_S),
        replace_lost_agent=nnodes == "2" and what != "rank",
    )
    assert_survived(job, FAILURE_TIMEOUT_S)
    assert_replays_identical(tmp_path)
    if what != "rank" and nnodes == "1:2":
        assert_on_course(tmp_path, one_process)
    else:
        assert_bit_identical(tmp_path, request.getfixturevalue("four_ranks"))


@pytest.mark.slow
@pytest.mark.skipif(not (FULL or ROTATION), reason="CHECKFREQ_FAULT_MATRIX=1 or ci runs it")
@pytest.mark.parametrize("what", ["rank", "agent"] if FULL else ["agent"])
def test_a_rank_or_node_lost_in_a_restores_exchange_never_hangs_the_job(
    four_ranks: Path, tmp_path: Path, what: str
) -> None:
    """A first fault makes the job restart (rank 3 lost between checkpoints); rank 3, or node 1, is then
    lost as the restore exchanges data; node 1 comes back (``--nnodes 2``): bit-identical."""
    job = run_job(
        tmp_path,
        "2",
        f"between:3:5:rank,restore:3:0:{what}",
        "--failure-timeout",
        str(FAILURE_TIMEOUT_S),
        replace_lost_agent=True,
    )
    assert_survived(job, FAILURE_TIMEOUT_S, count=2)
    assert_replays_identical(tmp_path)
    assert_bit_identical(tmp_path, four_ranks)


FSDP_ARGS = ("--epochs", "3", "--every", "4", "--memory", "1", "--replicas", "1")
"""fsdp_memory.py's job: 12 steps, a memory snapshot at each, copied to the other node, durable every 4."""
FSDP_STEPS = 12
REPLICA_CASES = [
    (phase, nnodes, what)
    for what in ("agent", "freeze")
    for nnodes in ("1:2", "2")
    for phase in ("replica-send", "replica-keep")
]
"""Node 1 killed or frozen mid-copy, as the sender or as the keeper, with both launch forms."""
ROTATING_REPLICA_CASES = [("replica-send", "1:2", "agent"), ("replica-keep", "2", "freeze")]


@pytest.fixture(scope="module")
def fsdp_four_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """fsdp_memory.py's job uninterrupted at 4 ranks under one agent."""
    work = tmp_path_factory.mktemp("fsdp-four-ranks")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "--monitor-interval",
        "0.1",
        str(SCRIPTS / "fsdp_memory.py"),
        "--ckpt-dir",
        str(work / "ckpt"),
        "--final",
        str(work / "final"),
        "--step-log",
        str(work / "steps.log"),
        *FSDP_ARGS,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", SHM_DIR_ENV: str(work)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return work


@pytest.mark.slow
@pytest.mark.skipif(not (FULL or ROTATION), reason="CHECKFREQ_FAULT_MATRIX=1 or ci runs it")
@pytest.mark.parametrize(("phase", "nnodes", "what"), REPLICA_CASES if FULL else ROTATING_REPLICA_CASES)
def test_a_node_lost_mid_replica_transfer_never_hangs_the_job_nor_leaves_a_usable_partial_copy(
    fsdp_four_ranks: Path, tmp_path: Path, phase: str, nnodes: str, what: str
) -> None:
    """FSDP2, a memory snapshot at every step, each copied to the other node (``replicas=1``). Node 1
    (its agent and workers) is SIGKILLed (``agent``) or SIGSTOPped (``freeze``: its connections stay
    open) while a copy of step 6 or later is in flight: as rank 3 sends its own (the data sent, the
    manifest not: ``replica-send``), or as rank 3 has received all of rank 1's and not committed it
    (``replica-keep``). No worker outlives the loss by more than the failure timeout plus the
    margin, whatever its copy threads and FSDP's collectives were waiting on (a frozen node: the
    copy threads' watch finds its silent heartbeats, and the survivors name it); the job resumes
    (``--nnodes 1:2``: at 2 ranks, on course; ``--nnodes 2``: bit-identical, node 1 started again
    on a new machine, empty memory and disk, after ``replica-send`` or a freeze, on its own
    machine, its memory kept, after ``replica-keep``). The copy cut short is never used: the
    keeper's machine never lists it as a valid copy (node 0, or node 1 back on its machine), and,
    rank 3's own copy cut short, no restore after the loss is at its step or later."""
    job = run_job(
        tmp_path,
        nnodes,
        f"{phase}:3:6:{what}",
        "--failure-timeout",
        str(FAILURE_TIMEOUT_S),
        replace_lost_agent=nnodes == "2",
        fsdp=True,
        new_machine=phase == "replica-send",
    )
    # a killed node: FSDP's own collectives fail first, and gloo names no rank; a frozen one: its heartbeats do
    assert_survived(job, FAILURE_TIMEOUT_S, named=what == "freeze")
    record = job.faults[0].record
    assert record["phase"] == phase and record["step"] >= 6, record
    kept = re.findall(r"keeps copy of rank (\d+) step=(\d+) valid=(\w+)", job.out["node0"])
    if phase == "replica-send":  # rank 3's copy of record["step"] was cut short on rank 1, which lives on
        assert any(r == "3" and int(s) < record["step"] and v == "True" for r, s, v in kept), (record, kept)
        assert all(step != str(record["step"]) for rank, step, _ in kept if rank == "3"), (record, kept)
        after = [
            int(step)
            for step, at in re.findall(r"restored step=(\d+) at=([\d.]+)", job.text)
            if float(at) > record["time"]
        ]
        assert after and max(after) < record["step"], (record, after)
    if phase == "replica-keep" and what == "agent":  # rank 1's copy thread, waiting for rank 3's answer, got an error
        assert f"copying snapshot {record['step']} to rank 3 failed" in job.out["node0"], job.out["node0"][-4000:]
    if what == "freeze":  # found by the copies' watch: no wait of FSDP's nor of a copy thread outlasts it
        assert "stopped answering during the copies of memory snapshots between machines" in job.out["node0"], job.out[
            "node0"
        ][-4000:]
    if phase == "replica-keep" and nnodes == "2" and what == "agent":  # node 1 back on its machine, the copy cut short
        kept = [
            found
            for name, text in job.out.items()
            if name.startswith("node1-")
            for found in re.findall(r"keeps copy of rank (\d+) step=(\d+) valid=(\w+)", text)
        ]
        assert any(r == "1" and int(s) < record["step"] and v == "True" for r, s, v in kept), (record, kept)
        assert all(step != str(record["step"]) for rank, step, _ in kept if rank == "1"), (record, kept)
    if nnodes == "2":
        for rank in range(4):
            assert_state_equal(
                torch.load(tmp_path / f"final.rank{rank}.pt"), torch.load(fsdp_four_ranks / f"final.rank{rank}.pt")
            )
    else:
        losses, expected = read_losses(tmp_path / "steps.log"), read_losses(fsdp_four_ranks / "steps.log")
        assert sorted(losses) == list(range(1, FSDP_STEPS + 1))
        torch.testing.assert_close(
            torch.tensor([losses[s] for s in sorted(losses)], dtype=torch.float64),
            torch.tensor([expected[s] for s in sorted(losses)], dtype=torch.float64),
            **TOLERANCE,
        )
        final, uninterrupted = torch.load(tmp_path / "final.full.pt"), torch.load(fsdp_four_ranks / "final.full.pt")
        torch.testing.assert_close(final, uninterrupted, **TOLERANCE)


def _leave_on_an_error(rank: int, store_path: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    result: dict = {}
    try:
        with cf.Checkpointer(
            Path(out) / f"node{rank}", policy=1, failure_timeout=FAILURE_TIMEOUT_S, model=model, optimizer=optimizer
        ) as ckpt:
            for step in range(1, 1000):
                model(torch.ones(8, 64)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
                ckpt.step()  # a checkpoint at every step: the ranks commit together
                if rank == 1 and step == 3:
                    result["raised"] = time.time()
                    raise ValueError("boom on rank 1")
                time.sleep(0.02)
    except ValueError as e:  # rank 1: out of its with block, the checkpoint in flight abandoned
        result.update(left=time.time(), error=str(e))
    except cf.PeerLostError as e:  # rank 0: its step() names rank 1 and why it left
        result.update(lost=time.time(), error=str(e))
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_a_rank_leaving_its_with_block_on_an_error_releases_the_other_ranks_at_once(tmp_path: Path) -> None:
    """Rank 1 raises inside ``with Checkpointer(...)`` while the ranks checkpoint at every step: it
    leaves its block within the failure timeout (the commit in flight abandoned, not waited for
    until ``persist_timeout``), and rank 0's next ``step()`` raises ``PeerLostError`` saying that
    rank 1 left, and on what, without waiting for the failure timeout."""
    spawn_ranks(_leave_on_an_error, (str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    survivor, leaver = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert leaver["error"] == "boom on rank 1" and leaver["left"] - leaver["raised"] < FAILURE_TIMEOUT_S + 1, leaver
    assert "rank 1 left on ValueError: boom on rank 1" in survivor["error"], survivor
    assert "rank 0 gives up" in survivor["error"] and survivor["lost"] - leaver["raised"] < FAILURE_TIMEOUT_S, survivor


def _gather_after_a_peer_is_gone(rank: int, store_path: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 3), rank=rank, world_size=3)
    _, (group,) = new_gloo_groups(["commit"], timedelta(seconds=60))
    liveness = Liveness(dist.PrefixStore("liveness", default_store()), rank, 3, 5.0)
    peers = GroupPeers(group, liveness, "the test's gather")
    peers.gather(rank)  # rank 0 is connected to every rank
    done = Path(out, "done")
    if rank == 2:
        Path(out, "pid2.tmp").write_text(str(os.getpid()))
        Path(out, "pid2.tmp").rename(Path(out, "pid2"))  # whole when rank 0 reads it
        exit_without_teardown()  # its connections close, as a killed process's do
    if rank == 1:  # alive until rank 0 is done
        while not done.exists():
            time.sleep(0.05)
    if rank == 0:
        while not Path(out, "pid2").exists() or alive({int(Path(out, "pid2").read_text())}):
            time.sleep(0.05)
        time.sleep(1.0)  # gloo has seen the connection close: a message to rank 2 is refused as it is posted
        try:
            peers.gather(rank)
        except cf.PeerLostError as e:
            Path(out, "error").write_text(str(e))
        done.touch()
    liveness.stop()


def test_a_rank_gone_before_a_gather_is_posted_is_named_at_once(tmp_path: Path) -> None:
    """Rank 2 has left (its connections closed) before rank 0 posts a gather (a commit's reports, as a
    loaded rank 0 does once its own file is written): gloo refuses the message to rank 2 as it is
    posted, and rank 0's error names rank 2 as the rank that closed its connection, at once, rather
    than a rank whose heartbeat stopped, a failure timeout later."""
    spawn_ranks(_gather_after_a_peer_is_gone, (str(tmp_path / "store"), str(tmp_path)), nprocs=3)
    pid = (tmp_path / "pid2").read_text()
    error = (tmp_path / "error").read_text()
    assert f"rank 2 ({socket.gethostname()}, pid {pid}) closed its connection during the test's gather" in error, error


def _second_survivor_after_the_store_host_left(rank: int, store_path: str, out: str, port: int) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 3), rank=rank, world_size=3)
    _, (group,) = new_gloo_groups(["commit"], timedelta(seconds=60))
    # the heartbeats' store lives in rank 0's process, as when torchrun does not share its own
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=rank == 0, timeout=timedelta(seconds=30))
    liveness = Liveness(dist.PrefixStore("liveness", store), rank, 3, 5.0)
    peers = GroupPeers(group, liveness, "the test's gather")
    peers.gather(rank)  # rank 0 is connected to every rank
    if rank == 2:
        Path(out, "pid2.tmp").write_text(str(os.getpid()))
        Path(out, "pid2.tmp").rename(Path(out, "pid2"))  # whole when rank 0 reads it
        exit_without_teardown()  # its connections close, as a killed process's do
    if rank == 0:  # finds rank 2 gone, gives up and leaves: its store goes with it
        while not Path(out, "pid2").exists() or alive({int(Path(out, "pid2").read_text())}):
            time.sleep(0.05)
        time.sleep(1.0)
        try:
            peers.gather(rank)
        except cf.PeerLostError as e:
            Path(out, "error0").write_text(str(e))
        exit_without_teardown()
    try:  # rank 1: waiting on rank 0, the rank that gave up
        peers.broadcast(None)
    except cf.PeerLostError as e:
        Path(out, "error1").write_text(str(e))
    liveness.stop()


def test_a_second_survivor_names_the_lost_rank_not_the_survivor_that_gave_up_first(tmp_path: Path) -> None:
    """Rank 2 is lost; rank 0, which hosts the heartbeats' store, finds it and gives up; rank 1 was
    waiting on rank 0. Rank 0 leaves only once rank 1 has read why the job failed (or a heartbeat
    interval later), so rank 1's error names rank 2, with its host and pid, as rank 0's does, rather
    than rank 0, whose connection closed, with neither (its store gone with it)."""
    spawn_ranks(
        _second_survivor_after_the_store_host_left, (str(tmp_path / "store"), str(tmp_path), free_port()), nprocs=3
    )
    lost = f"rank 2 ({socket.gethostname()}, pid {(tmp_path / 'pid2').read_text()}) closed its connection"
    first, second = ((tmp_path / f"error{rank}").read_text() for rank in (0, 1))
    assert lost in first and "(seen by rank 0)" in first, first
    assert lost in second and "(seen by rank 0)" in second and "rank 1 gives up" in second, second
    assert "rank 0 closed" not in second
