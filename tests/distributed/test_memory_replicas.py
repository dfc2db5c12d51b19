"""Memory snapshots copied to other nodes (``replicas=``): a node lost for good with its memory and
its disk, under ``torchrun --nnodes 1:2``, FSDP2 (and DDP) on two agents of two ranks (CPU, gloo),
each agent its own shared memory and local directory, a shared remote tier; two of three nodes lost
with ``replicas=2``, and a damaged copy that gives way to the next keeper's.

With replicas the survivors resume at world size 2 from the newest memory step, putting each
parameter's new blocks together from their own shards and the copies of the lost node's, and
finish on course; without, from the newest durable checkpoint. A copy with one byte changed is
found at the restore, named in the log with its keeper and what is read instead."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fsdp_memory import read_losses

from checkfreq.run.events import read_events
from checkfreq.storage.shm import MemoryRegion
from checkfreq.storage.shm_paths import SHM_DIR_ENV, device_and_inode, replica_path
from checkfreq.tools.report import load_run, summary_text
from helpers import SCRIPTS, assert_state_equal, free_port, kill_tree

pytestmark = pytest.mark.slow
STEPS, KILL, EVERY = 12, 6, 4  # 64 samples, global batches of 16, 3 epochs; durable checkpoints at 4, 8, 12
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}  # the same global batches, summed in another order at 2 ranks
ARGS = ("--epochs", "3", "--every", str(EVERY), "--memory", "1")
THREE = ("--samples", "48", "--global-batch", "12")
"""Three nodes of one rank: 48 samples in global batches of 12 (at 3 ranks and at 1), 12 steps again."""
LAGGING = ("--ballast-mb", "48")
"""48 MiB of each rank's own: a snapshot's copy to the other node takes longer than a step."""
PRIVATE = 4 + 624 * 4 + 5056
"""A DDP rank's private tensors: ``seen`` (float32), numpy's RNG key (624 uint32) and torch's CPU RNG state."""


def _agent(
    work: Path, node: int, port: int, *extra: str, nnodes: str = "1:2", nproc: int = 2
) -> subprocess.Popen[bytes]:
    """A torchrun agent of ``nproc`` ranks of a job of ``nnodes`` nodes on 127.0.0.<node+1>; node 0 hosts
    the rendezvous store, which must outlive the nodes that are lost."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        SHM_DIR_ENV: str(work / f"shm{node}"),
    }
    (work / f"shm{node}").mkdir(exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        str(nproc),
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
        str(SCRIPTS / "fsdp_memory.py"),
        "--ckpt-dir",
        str(work / f"node{node}"),
        "--final",
        str(work / "final"),
        "--step-log",
        str(work / "steps.log"),
        "--kill-marker",
        str(work / "killed"),
        *ARGS,
        *extra,
    ]
    log = (work / f"node{node}.out").open("a")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _uninterrupted(work: Path, *extra: str, nproc: int = 4) -> Path:
    """The uninterrupted job at world size ``nproc``."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(SCRIPTS / "fsdp_memory.py"),
        "--ckpt-dir",
        str(work / "ckpt"),
        "--final",
        str(work / "final"),
        "--step-log",
        str(work / "steps.log"),
        *ARGS,
        *extra,
    ]
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1", SHM_DIR_ENV: str(work)},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return work


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _uninterrupted(tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def three_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _uninterrupted(tmp_path_factory.mktemp("three_reference"), *THREE, nproc=3)


@pytest.fixture(scope="module")
def lagging_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _uninterrupted(tmp_path_factory.mktemp("lagging_reference"), *LAGGING)


@pytest.fixture(scope="module")
def three_lagging_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _uninterrupted(tmp_path_factory.mktemp("three_lagging_reference"), *THREE, *LAGGING, nproc=3)


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _uninterrupted(tmp_path_factory.mktemp("ddp_reference"), "--ddp")


@pytest.mark.parametrize(("replicas", "resumed"), [(1, KILL), (0, EVERY)])
def test_a_node_lost_for_good_resumes_from_the_copies_of_its_shards(
    reference: Path, tmp_path: Path, replicas: int, resumed: int
) -> None:
    port = free_port()
    extra = ("--replicas", str(replicas), "--remote", str(tmp_path / "remote"), "--kill-node", str(KILL))
    agents = [_agent(tmp_path, node, port, *extra) for node in (0, 1)]
    try:
        assert agents[1].wait(timeout=200) == -9, (tmp_path / "node1.out").read_text()[-3000:]
        for gone in (tmp_path / "shm1", tmp_path / "node1"):  # the node's memory and disk go with it
            subprocess.run(["rm", "-rf", str(gone)], check=True)
        assert agents[0].wait(timeout=200) == 0, (tmp_path / "node0.out").read_text()[-4000:]
    finally:
        for agent in agents:
            kill_tree(agent.pid)
    out = (tmp_path / "node0.out").read_text()
    restores = sorted(line.split("] ")[-1] for line in out.splitlines() if "restored step=" in line)
    assert restores[-2:] == [
        f"life=1 rank=0 world=2 restored step={resumed}",
        f"life=1 rank=1 world=2 restored step={resumed}",
    ], out[-4000:]
    tiers = {
        (e["rank"], e["tier"])
        for e in read_events(tmp_path / "node0")
        if e["event"] == "restore" and e["world_size"] == 2
    }
    copies = [e for e in read_events(tmp_path / "node0") if e["event"] == "replica" and e["kept"]]
    if replicas:  # nothing read from disk or the remote tier; each survivor had copied its snapshots to node 1
        assert tiers == {(0, "memory"), (1, "memory")}, tiers
        assert {(e["rank"], e["to"]) for e in copies} == {(0, 2), (1, 3)}, copies
        text = summary_text(load_run(tmp_path / "node0"))  # checkfreq report: rank 0's, as for its other series
        kept = len([e for e in copies if e["rank"] == 0])
        assert f"memory copies on another machine: {kept} kept there" in text, text
    else:
        assert not copies
    losses, expected = read_losses(tmp_path / "steps.log"), read_losses(reference / "steps.log")
    assert sorted(losses) == list(range(1, STEPS + 1))
    torch.testing.assert_close(
        torch.tensor([losses[s] for s in sorted(losses)], dtype=torch.float64),
        torch.tensor([expected[s] for s in sorted(losses)], dtype=torch.float64),
        **TOLERANCE,
    )
    torch.testing.assert_close(
        torch.load(tmp_path / "final.full.pt"), torch.load(reference / "final.full.pt"), **TOLERANCE
    )


def test_a_replacement_node_takes_its_ranks_snapshots_from_the_copies(reference: Path, tmp_path: Path) -> None:
    """``--nnodes 2``: node 1 lost after step 6 with its memory and disk, a new node 1 (empty memory,
    empty directory) joins; its ranks take their snapshots of step 6 from the copies node 0's ranks
    kept, every rank resumes from memory, and the job ends bit-identical to the uninterrupted one."""
    port = free_port()
    extra = ("--replicas", "1", "--remote", str(tmp_path / "remote"), "--kill-node", str(KILL))
    agents = [_agent(tmp_path, node, port, *extra, nnodes="2") for node in (0, 1)]
    try:
        assert agents[1].wait(timeout=200) == -9, (tmp_path / "node1.out").read_text()[-3000:]
        for gone in (tmp_path / "shm1", tmp_path / "node1"):
            subprocess.run(["rm", "-rf", str(gone)], check=True)
        agents.append(_agent(tmp_path, 1, port, *extra, nnodes="2"))  # the replacement
        codes = [agents[0].wait(timeout=200), agents[2].wait(timeout=200)]
        assert codes == [0, 0], [(tmp_path / f"node{n}.out").read_text()[-3000:] for n in (0, 1)]
    finally:
        for agent in agents:
            kill_tree(agent.pid)
    restores = {
        (e["rank"], e["step"], e["tier"])
        for node in (0, 1)
        for e in read_events(tmp_path / f"node{node}")
        if e["event"] == "restore"
    }
    assert restores == {(rank, KILL, "memory") for rank in range(4)}, restores
    for rank in range(4):
        expected = torch.load(reference / f"final.rank{rank}.pt")
        assert_state_equal(torch.load(tmp_path / f"final.rank{rank}.pt"), expected)


def _lose_node(work: Path, port: int, extra: tuple[str, ...], nnodes: str) -> list[subprocess.Popen[bytes]]:
    """Both agents started, node 1 lost after step ``KILL`` with its memory and disk; with ``--nnodes 2``
    a replacement agent (empty memory and disk) started; every agent waited for."""
    agents = [_agent(work, node, port, *extra, nnodes=nnodes) for node in (0, 1)]
    try:
        assert agents[1].wait(timeout=200) == -9, (work / "node1.out").read_text()[-3000:]
        for gone in (work / "shm1", work / "node1"):
            subprocess.run(["rm", "-rf", str(gone)], check=True)
        if nnodes == "2":
            agents.append(_agent(work, 1, port, *extra, nnodes=nnodes))
        codes = [agents[0].wait(timeout=200), *(a.wait(timeout=200) for a in agents[2:])]
        assert set(codes) == {0}, [(work / f"node{n}.out").read_text()[-3000:] for n in (0, 1)]
    finally:
        for agent in agents:
            kill_tree(agent.pid)
    return agents


@pytest.mark.parametrize("nnodes", ["1:2", "2"])
def test_ddp_copies_carry_no_replicated_bytes_and_a_lost_node_resumes_from_memory(
    ddp_reference: Path, tmp_path: Path, nnodes: str
) -> None:
    """DDP, ``replicas=1``: each copy of a snapshot carries the rank's private bytes (``PRIVATE``) and
    its manifest, not its share of the replicated parameters and AdamW state, which
    every machine holds. Node 1 lost for good (``--nnodes 1:2``): the survivors resume at world size 2
    from step 6 in their memory, on course. A replacement node (``--nnodes 2``): its ranks take their
    snapshots of step 6 from the copies, made whole by their keepers from node 0's own shares, and the
    job ends bit-identical to the uninterrupted one. Nothing is read from disk or the remote tier."""
    extra = ("--ddp", "--replicas", "1", "--remote", str(tmp_path / "remote"), "--kill-node", str(KILL))
    _lose_node(tmp_path, free_port(), extra, nnodes)
    copies = [e for e in read_events(tmp_path / "node0") if e["event"] == "replica" and e["kept"]]
    assert {(e["rank"], e["to"]) for e in copies} == {(0, 2), (1, 3)}, copies
    assert {e["data_bytes"] for e in copies} == {PRIVATE}, copies  # no replicated byte
    assert all(e["slot_bytes"] - e["bytes"] > 4096 for e in copies), copies  # the slot's share was left out
    if nnodes == "1:2":
        restores = {
            (e["rank"], e["step"], e["tier"])
            for e in read_events(tmp_path / "node0")
            if e["event"] == "restore" and e["world_size"] == 2
        }
        assert restores == {(0, KILL, "memory"), (1, KILL, "memory")}, restores
        losses, expected = read_losses(tmp_path / "steps.log"), read_losses(ddp_reference / "steps.log")
        assert sorted(losses) == list(range(1, STEPS + 1))
        torch.testing.assert_close(
            [losses[s] for s in sorted(losses)], [expected[s] for s in sorted(losses)], **TOLERANCE
        )
        torch.testing.assert_close(
            torch.load(tmp_path / "final.full.pt"), torch.load(ddp_reference / "final.full.pt"), **TOLERANCE
        )
        return
    restores = {
        (e["rank"], e["step"], e["tier"])
        for node in (0, 1)
        for e in read_events(tmp_path / f"node{node}")
        if e["event"] == "restore"
    }
    assert restores == {(rank, KILL, "memory") for rank in range(4)}, restores
    for rank in range(4):
        assert_state_equal(
            torch.load(tmp_path / f"final.rank{rank}.pt"), torch.load(ddp_reference / f"final.rank{rank}.pt")
        )


@pytest.mark.parametrize("nnodes", ["1:2", "2"])
def test_a_node_lost_while_its_copies_lag_leaves_a_step_every_rank_restores_from_memory(
    lagging_reference: Path, tmp_path: Path, nnodes: str
) -> None:
    """FSDP2, ``memory=1``, ``replicas=1``, each rank 48 MiB of its own state: copying a snapshot to the
    other node takes longer than a step. Node 1 goes at once after step 7, its copies in flight, with
    its memory and disk (no remote tier). The survivors (``1:2``), or they and a replacement node
    (``2``), restore every rank from memory at a step no more than two snapshots back, and the job
    ends on the uninterrupted run's course."""
    extra = (*LAGGING, "--replicas", "1", "--lose-node-now", "7")
    _lose_node(tmp_path, free_port(), extra, nnodes)
    events = [e for node in (0, 1) for e in read_events(tmp_path / f"node{node}")]
    restores = {(e["rank"], e["step"], e["tier"]) for e in events if e["event"] == "restore"}
    steps = {step for _, step, _ in restores}
    assert len(steps) == 1 and 5 <= min(steps) <= 7, restores
    assert {tier for _, _, tier in restores} == {"memory"}, restores
    assert len(restores) == (2 if nnodes == "1:2" else 4), restores
    waits = [e for e in events if e["event"] == "replica wait"]
    assert all(e["seconds"] >= 0 and e["done"] for e in waits), waits
    losses, expected = read_losses(tmp_path / "steps.log"), read_losses(lagging_reference / "steps.log")
    assert sorted(losses) == list(range(1, STEPS + 1))
    torch.testing.assert_close([losses[s] for s in sorted(losses)], [expected[s] for s in sorted(losses)], **TOLERANCE)
    if nnodes == "1:2":
        torch.testing.assert_close(
            torch.load(tmp_path / "final.full.pt"), torch.load(lagging_reference / "final.full.pt"), **TOLERANCE
        )
        return
    for rank in range(4):
        assert_state_equal(
            torch.load(tmp_path / f"final.rank{rank}.pt"), torch.load(lagging_reference / f"final.rank{rank}.pt")
        )


def test_two_of_three_nodes_lost_for_good_resume_from_the_two_copies_the_survivor_keeps(
    three_reference: Path, tmp_path: Path
) -> None:
    """FSDP2 on three agents of one rank (``--nnodes 1:3``), ``replicas=2``: each node's snapshots are
    copied to both other nodes. Nodes 1 and 2 lost for good after step 6 with their memory and disk:
    the survivor restarts alone, takes its shards and the copies it keeps of both lost ranks' (with
    ``replicas=1`` it would keep rank 2's only), reshards at world size 1 from step 6 in memory, and
    finishes on course."""
    port = free_port()
    extra = (
        *THREE,
        "--replicas",
        "2",
        "--remote",
        str(tmp_path / "remote"),
        "--kill-node",
        str(KILL),
        "--lost-nodes",
        "2",
    )
    agents = [_agent(tmp_path, node, port, *extra, nnodes="1:3", nproc=1) for node in (0, 1, 2)]
    try:
        assert [agents[n].wait(timeout=200) for n in (1, 2)] == [-9, -9], (tmp_path / "node1.out").read_text()[-3000:]
        for gone in ("shm1", "node1", "shm2", "node2"):
            subprocess.run(["rm", "-rf", str(tmp_path / gone)], check=True)
        assert agents[0].wait(timeout=200) == 0, (tmp_path / "node0.out").read_text()[-4000:]
    finally:
        for agent in agents:
            kill_tree(agent.pid)
    events = read_events(tmp_path / "node0")
    copies = {(e["to"], e["step"]) for e in events if e["event"] == "replica" and e["kept"]}
    assert {(1, KILL), (2, KILL)} <= copies, copies  # rank 0's own snapshots went to both other nodes
    restores = [(e["step"], e["tier"]) for e in events if e["event"] == "restore" and e["world_size"] == 1]
    assert restores == [(KILL, "memory")], restores
    losses, expected = read_losses(tmp_path / "steps.log"), read_losses(three_reference / "steps.log")
    assert sorted(losses) == list(range(1, STEPS + 1))
    torch.testing.assert_close([losses[s] for s in sorted(losses)], [expected[s] for s in sorted(losses)], **TOLERANCE)
    torch.testing.assert_close(
        torch.load(tmp_path / "final.full.pt"), torch.load(three_reference / "final.full.pt"), **TOLERANCE
    )


def test_a_keeper_lost_mid_copy_with_two_replicas_leaves_a_step_every_rank_restores_from_memory(
    three_lagging_reference: Path, tmp_path: Path
) -> None:
    """FSDP2 on three agents of one rank (``--nnodes 1:3``), ``replicas=2``, each rank 48 MiB of its
    own: copies lag. Node 2 keeps the copies of both other nodes and sends its own to both; it goes at
    once after step 7, copies to it and from it in flight, with its memory and disk (no remote tier).
    The survivors restore both ranks from memory (their own snapshots, and the copies each keeps of
    rank 2's) at a step no more than two snapshots back, and finish on the uninterrupted run's course."""
    port = free_port()
    extra = (*THREE, *LAGGING, "--replicas", "2", "--lose-node-now", "7")
    agents = [_agent(tmp_path, node, port, *extra, nnodes="1:3", nproc=1) for node in (0, 1, 2)]
    try:
        assert agents[2].wait(timeout=200) == -9, (tmp_path / "node2.out").read_text()[-3000:]
        for gone in ("shm2", "node2"):
            subprocess.run(["rm", "-rf", str(tmp_path / gone)], check=True)
        codes = [agents[n].wait(timeout=200) for n in (0, 1)]
        assert codes == [0, 0], [(tmp_path / f"node{n}.out").read_text()[-3000:] for n in (0, 1)]
    finally:
        for agent in agents:
            kill_tree(agent.pid)
    events = [e for node in (0, 1) for e in read_events(tmp_path / f"node{node}")]
    restores = {(e["rank"], e["step"], e["tier"]) for e in events if e["event"] == "restore" and e["world_size"] == 2}
    steps = {step for _, step, _ in restores}
    assert len(restores) == 2 and len(steps) == 1 and 5 <= min(steps) <= 7, restores
    assert {tier for _, _, tier in restores} == {"memory"}, restores
    losses, expected = read_losses(tmp_path / "steps.log"), read_losses(three_lagging_reference / "steps.log")
    assert sorted(losses) == list(range(1, STEPS + 1))
    torch.testing.assert_close([losses[s] for s in sorted(losses)], [expected[s] for s in sorted(losses)], **TOLERANCE)
    torch.testing.assert_close(
        torch.load(tmp_path / "final.full.pt"), torch.load(three_lagging_reference / "final.full.pt"), **TOLERANCE
    )


def test_a_damaged_copy_gives_way_to_the_next_keepers(three_reference: Path, tmp_path: Path) -> None:
    """FSDP2 on three agents of one rank (``--nnodes 3``), ``replicas=2``: node 2 lost after step 6 and
    replaced (empty memory and disk). Its rank's copy of step 6 on node 0, the first keeper, has a
    byte flipped: the restore names it, takes the copy node 1 keeps instead, and every rank resumes
    from step 6 in memory, bit-identical to the uninterrupted run."""
    port = free_port()
    extra = (*THREE, "--replicas", "2", "--remote", str(tmp_path / "remote"), "--kill-node", str(KILL))
    agents = [_agent(tmp_path, node, port, *extra, nnodes="3", nproc=1) for node in (0, 1, 2)]
    try:
        assert agents[2].wait(timeout=200) == -9, (tmp_path / "node2.out").read_text()[-3000:]
        for gone in ("shm2", "node2"):
            subprocess.run(["rm", "-rf", str(tmp_path / gone)], check=True)
        ckpt = tmp_path / "node0"  # node 0's copy of rank 2's newest snapshot, damaged in its memory
        copy = MemoryRegion(tmp_path / "shm0" / replica_path(ckpt, 2).name, device_and_inode(ckpt), tidy=False)
        info = copy.snapshots()[0]
        data, _ = copy.slot_bytes(info)
        data[0] ^= 0xFF
        copy.release(remove=False)
        agents.append(_agent(tmp_path, 2, port, *extra, nnodes="3", nproc=1))  # the replacement
        codes = [agents[n].wait(timeout=200) for n in (0, 1, 3)]
        assert codes == [0, 0, 0], [(tmp_path / f"node{n}.out").read_text()[-3000:] for n in (0, 1, 2)]
    finally:
        for agent in agents:
            kill_tree(agent.pid)
    assert info.step == KILL
    out = (tmp_path / "node2.out").read_text()  # one line: the snapshot, its keeper and host, the next keeper
    named = (
        re.escape(
            f"memory tier: rank 2's snapshot {KILL}: the copy kept by rank 0 ({socket.gethostname()}) "
            f"cannot be used (the copy of rank 2's memory snapshot {KILL} kept here cannot be read: "
        )
        + r".*fails its checksum.*\); trying the copy rank 1 keeps$"
    )
    assert re.search(named, out, re.MULTILINE) and out.count("the copy kept by rank") == 1, out[-3000:]
    restores = {
        (e["rank"], e["step"], e["tier"])
        for node in (0, 1, 2)
        for e in read_events(tmp_path / f"node{node}")
        if e["event"] == "restore"
    }
    assert restores == {(rank, KILL, "memory") for rank in range(3)}, restores
    for rank in range(3):
        assert_state_equal(
            torch.load(tmp_path / f"final.rank{rank}.pt"), torch.load(three_reference / f"final.rank{rank}.pt")
        )


@pytest.mark.parametrize("nnodes", ["2", "1:2"] if os.environ.get("CHECKFREQ_FAULT_MATRIX") == "1" else ["2"])
def test_a_copy_with_a_flipped_byte_is_passed_over_for_the_next_source(
    reference: Path, tmp_path: Path, nnodes: str
) -> None:
    """Node 1 lost after step 6 as in the tests above, but one byte of the copy of rank 2's snapshot 6
    that rank 0 keeps was changed first. The restore finds it (its checksum), logs the snapshot (rank
    2's, step 6), its keeper (rank 0, on this host) and what it reads instead: step 5, the newest
    step every shard can be read at, from the memory tier (rank 2's older copy). With a replacement
    node (``--nnodes 2``) every rank resumes at 5 and the job ends bit-identical to the
    uninterrupted one; with the node lost for good (``--nnodes 1:2``, ``CHECKFREQ_FAULT_MATRIX=1``),
    on course."""
    port = free_port()
    extra = ("--replicas", "1", "--remote", str(tmp_path / "remote"), "--kill-node", str(KILL), "--flip-copy")
    agents = [_agent(tmp_path, node, port, *extra, nnodes=nnodes) for node in (0, 1)]
    try:
        assert agents[1].wait(timeout=200) == -9, (tmp_path / "node1.out").read_text()[-3000:]
        for gone in (tmp_path / "shm1", tmp_path / "node1"):
            subprocess.run(["rm", "-rf", str(gone)], check=True)
        if nnodes == "2":
            agents.append(_agent(tmp_path, 1, port, *extra, nnodes="2"))  # the replacement
        codes = [agent.wait(timeout=200) for agent in agents[::2]]
        assert codes == [0] * len(codes), [(tmp_path / f"node{n}.out").read_text()[-3000:] for n in (0, 1)]
    finally:
        for agent in agents:
            kill_tree(agent.pid)
    out = [(tmp_path / f"node{n}.out").read_text() for n in (0, 1)]
    assert f"flipped a byte of the copy of rank 2's snapshot {KILL}" in out[0], out[0][-3000:]
    host = socket.gethostname()
    if nnodes == "2":  # rank 2 (the new node) is sent the damaged copy by rank 0, and takes the next source
        named = (
            re.escape(
                f"memory tier: rank 2's snapshot {KILL}: the copy kept by rank 0 ({host}) cannot be used "
                f"(the copy of rank 2's memory snapshot {KILL} kept here cannot be read: slot "
            )
            + r"\d "
            + re.escape(f"(step {KILL}) fails its checksum: torn or damaged); ")
            + r"(taking snapshot (\d+) over from the copies|restoring memory snapshot (\d+), which|no copy left)"
        )
        found = re.search(named, out[1])
        assert found and out[1].count("the copy kept by rank") == 1, out[1][-4000:]  # its machine's one copy, once
        restores = {
            (e["rank"], e["step"], e["tier"])
            for node in (0, 1)
            for e in read_events(tmp_path / f"node{node}")
            if e["event"] == "restore"
        }
        step = int(found[2] or found[3] or 0)  # the step the log says is restored instead (0: from disk)
        steps, tiers = {s for _, s, _ in restores}, {t for _, _, t in restores}
        if step:
            assert steps == {step} and tiers == {"memory"}, restores
        else:
            assert len(steps) == 1 and max(steps) < KILL and "memory" not in tiers, restores
        for rank in range(4):
            assert_state_equal(
                torch.load(tmp_path / f"final.rank{rank}.pt"), torch.load(reference / f"final.rank{rank}.pt")
            )
        return
    named = (
        re.escape(
            f"memory tier: snapshot {KILL} cannot be put together (rank 0: rank 2's share of memory "
            f"snapshot {KILL} is on no region of this machine ({host}) (the copy kept here, "
        )
        + ".*"
        + re.escape("fails its checksum: torn or damaged)); restoring ")
        + r"(snapshot (\d+)|from disk) instead"
    )
    found = re.search(named, out[0])
    assert found, out[0][-4000:]
    tiers = {
        (e["rank"], e["step"], e["tier"])
        for e in read_events(tmp_path / "node0")
        if e["event"] == "restore" and e["world_size"] == 2
    }
    if found[2]:  # the newest step every shard can be read at: an older memory snapshot (rank 2's older copy)
        assert tiers == {(0, int(found[2]), "memory"), (1, int(found[2]), "memory")}, tiers
    else:
        assert all(step < KILL and tier != "memory" for _, step, tier in tiers), tiers
    losses, expected = read_losses(tmp_path / "steps.log"), read_losses(reference / "steps.log")
    assert sorted(losses) == list(range(1, STEPS + 1))
    torch.testing.assert_close(
        torch.tensor([losses[s] for s in sorted(losses)], dtype=torch.float64),
        torch.tensor([expected[s] for s in sorted(losses)], dtype=torch.float64),
        **TOLERANCE,
    )
