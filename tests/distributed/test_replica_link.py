"""The copies of memory snapshots between two real gloo ranks (checkfreq.pipeline.tiers.memory.replicas): a copy
is kept only once its bytes match the sender's checksum; one damaged on the way, or cut short by
the sender's death, is never committed, and the keeper's newest good copy stays. A sender that
freezes mid-copy is found by its heartbeats, and the keeper's process ends."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from checkfreq.pipeline.tiers.memory import replicas
from checkfreq.pipeline.tiers.memory.replicas import CopyHeader, ReplicaLink
from checkfreq.ranks.compat import default_store
from checkfreq.ranks.liveness import Liveness
from checkfreq.storage.format import Manifest
from checkfreq.storage.shm import MemoryRegion
from checkfreq.storage.shm_paths import SHM_DIR_ENV, device_and_inode, replica_path
from checkfreq.tools.catalog import memory_snapshots
from helpers import spawn_ranks, tmpfs

pytestmark = pytest.mark.slow


def _commit(region: MemoryRegion, step: int, fill: int) -> object:
    region.reserve(1 << 16, 1024)
    slot = region.begin()
    slot.data[: 1 << 16] = fill
    meta = Manifest(step=step, epoch=0, world_size=1, files={}, tensors={}, state=None, versions={}, created=0.0)
    return region.commit(slot, step, 1 << 16, meta.to_json(), b"s" * 16)


def _ranks(rank: int, work: Path, case: str) -> None:
    os.environ[SHM_DIR_ENV] = str(work / f"shm{rank}")
    dist.init_process_group(
        "gloo", init_method=f"file://{work / 'store'}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    directory = work / "ckpt"
    if rank == 0:  # the sender: its own region, two snapshots
        region = MemoryRegion(work / "shm0" / "own", device_and_inode(directory))
        link = ReplicaLink(dist.group.WORLD, directory, sends_to=1, receives_from=[])
        assert link.offer(region, _commit(region, 3, 7)) and link.wait_sent(30)
        info = _commit(region, 4, 9)
        if case == "damaged":  # a byte changed after the checksum was taken: what a bad link or memory does
            data, _ = region.slot_bytes(info)
            data[100] ^= 1
        if case == "died":  # the header, then the sender is gone
            dist.send(
                CopyHeader.announcing(info).to_tensor(), group=dist.group.WORLD, group_dst=1, tag=replicas.COPY_TAG
            )
            os._exit(0)
        assert link.offer(region, info) and link.wait_sent(30)
        link.close(30)
        (work / "sent.json").write_text(json.dumps([s.step for s in link.sent]))
    else:  # the keeper
        link = ReplicaLink(dist.group.WORLD, directory, sends_to=None, receives_from=[0])
        link.close(60)
        kept = MemoryRegion(replica_path(directory, 0), device_and_inode(directory), tidy=False)
        found = [(info.step, int(kept.read(info)[1][0])) for info in kept.snapshots()]
        (work / "kept.json").write_text(json.dumps(found))
        listed = [(s.name.rsplit(" slot", 1)[0], s.step, s.valid) for s in memory_snapshots(directory)]
        assert listed == [("memory copy of rank 0", step, True) for step, _ in found], listed  # checkfreq ls


@pytest.mark.parametrize(
    ("case", "kept", "sent"),
    [
        ("good", [[4, 9], [3, 7]], [3, 4]),
        ("damaged", [[3, 7]], [3]),
        ("died", [[3, 7]], None),
    ],
)
def test_only_a_copy_that_matches_its_checksum_is_kept(tmp_path: Path, case: str, kept: list, sent: list) -> None:
    for rank in (0, 1):
        (tmp_path / f"shm{rank}").mkdir()
    (tmp_path / "ckpt").mkdir()
    spawn_ranks(_ranks, (tmp_path, case), nprocs=2)  # "died": rank 0 leaves mid-copy, the keeper still ends
    if sent is not None:
        assert json.loads((tmp_path / "sent.json").read_text()) == sent
    assert json.loads((tmp_path / "kept.json").read_text()) == kept


def test_a_keeper_without_room_refuses_the_copies_and_both_ranks_go_on(tmp_path: Path) -> None:
    """The keeper's shared memory cannot hold a region: each copy is received, dropped and answered
    as not kept; the sender counts none and ends normally."""
    (tmp_path / "shm0").mkdir()
    (tmp_path / "ckpt").mkdir()
    with tmpfs(tmp_path / "shm1", "128k"):
        spawn_ranks(_ranks, (tmp_path, "good"), nprocs=2)
    assert json.loads((tmp_path / "sent.json").read_text()) == []
    assert json.loads((tmp_path / "kept.json").read_text()) == []


FROZEN_TIMEOUT_S = 2.0
"""The failure timeout of the frozen-sender case: the keeper must be gone well within 2 of them + a beat."""


def _frozen(rank: int, work: Path) -> None:
    """Rank 0 sends one copy, then the header of the next, and freezes (SIGSTOP: its connections stay
    open); rank 1, the keeper, watched by the job's heartbeats, blocks its main thread for a minute."""
    logging.basicConfig(filename=work / f"rank{rank}.log", level=logging.INFO)
    os.environ[SHM_DIR_ENV] = str(work / f"shm{rank}")
    dist.init_process_group(
        "gloo", init_method=f"file://{work / 'store'}", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    liveness = Liveness(dist.PrefixStore("liveness", default_store()), rank, 2, FROZEN_TIMEOUT_S)
    directory = work / "ckpt"
    if rank == 0:
        region = MemoryRegion(work / "shm0" / "own", device_and_inode(directory))
        link = ReplicaLink(dist.group.WORLD, directory, sends_to=1, receives_from=[], liveness=liveness)
        assert link.offer(region, _commit(region, 3, 7)) and link.wait_sent(30)
        header = CopyHeader.announcing(_commit(region, 4, 9))
        dist.send(header.to_tensor(), group=dist.group.WORLD, group_dst=1, tag=replicas.COPY_TAG)
        (work / "frozen").write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        ReplicaLink(dist.group.WORLD, directory, sends_to=None, receives_from=[0], liveness=liveness)
        time.sleep(60)  # a training thread blocked in a collective of its own with the frozen rank
    os._exit(0)


def test_a_sender_frozen_mid_copy_is_found_by_its_heartbeats_and_the_keeper_ends(tmp_path: Path) -> None:
    """The sender freezes after the header of a copy: its connections stay open, so the keeper's
    receive of the rest would wait for the group's timeout (a day). The link's watch reads the
    sender's heartbeat instead: silent for the failure timeout, the sender is named lost and the
    keeper's process ends itself (status 1) a failure timeout later, long before its main thread
    would return, so that torchrun can restart the job."""
    for rank in (0, 1):
        (tmp_path / f"shm{rank}").mkdir()
    (tmp_path / "ckpt").mkdir()
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=_frozen, args=(rank, tmp_path)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    try:
        ranks[1].join(60)
        assert (tmp_path / "frozen").exists(), (tmp_path / "rank1.log").read_text()
        frozen = json.loads((tmp_path / "frozen").read_text())
        gone = time.time() - frozen["time"]
        assert ranks[1].exitcode == 1, (ranks[1].exitcode, (tmp_path / "rank1.log").read_text())
        assert gone < 2 * FROZEN_TIMEOUT_S + 10, gone  # found after the timeout (+ a beat), ended one later
        log = (tmp_path / "rank1.log").read_text()
        assert (
            f"rank 0 ({socket.gethostname()}, pid {frozen['pid']}) stopped answering during the copies of "
            "memory snapshots between machines"
        ) in log, log
        assert "ending this process now" in log, log
    finally:
        for process in ranks:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGKILL)
            process.join(10)


def _outlasted(rank: int, work: Path) -> None:
    """Rank 0 offers three snapshots at once while its keeper is not yet listening: the first copy
    waits for the keeper, the next two are offered while it is in flight (as after a wait for it that
    outlasted the failure timeout)."""
    logging.basicConfig(filename=work / f"rank{rank}.log", level=logging.INFO)
    os.environ[SHM_DIR_ENV] = str(work / f"shm{rank}")
    dist.init_process_group(
        "gloo", init_method=f"file://{work / 'store'}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    directory = work / "ckpt"
    if rank == 0:
        region = MemoryRegion(work / "shm0" / "own", device_and_inode(directory), slots=3)
        link = ReplicaLink(dist.group.WORLD, directory, sends_to=1, receives_from=[])
        skipped: list[dict] = []
        link.report = lambda event, **fields: skipped.append({"event": event, **fields})
        offered = [link.offer(region, _commit(region, step, step)) for step in (3, 4, 5)]
        assert offered == [True, False, False]
        (work / "offered").touch()
        link.close(30)
        (work / "skipped.json").write_text(json.dumps(skipped))
    else:
        while not (work / "offered").exists():
            time.sleep(0.05)
        ReplicaLink(dist.group.WORLD, directory, sends_to=None, receives_from=[0]).close(60)


def test_a_snapshot_not_copied_is_said_once_with_why_and_what_to_do(tmp_path: Path) -> None:
    for rank in (0, 1):
        (tmp_path / f"shm{rank}").mkdir()
    (tmp_path / "ckpt").mkdir()
    spawn_ranks(_outlasted, (tmp_path,), nprocs=2)
    said = [line for line in (tmp_path / "rank0.log").read_text().splitlines() if "is not copied" in line]
    assert len(said) == 1, said
    assert "snapshot 4 is not copied to rank 1 (the previous copy is in flight)" in said[0]
    assert "stalled link or keeper" in said[0]
    skipped = json.loads((tmp_path / "skipped.json").read_text())
    assert [(s["event"], s["step"]) for s in skipped if s["event"] == "replica skipped"] == [
        ("replica skipped", 4),
        ("replica skipped", 5),
    ]
