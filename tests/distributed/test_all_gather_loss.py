"""A rank lost in an all-gather (the restore's rows, the replica claims) is named within a heartbeat
or so, not the failure timeout: gloo does not fail an all-gather whose rank died, so the ranks of its
machine see its process gone, and the others read why the job failed at their next beat."""

from __future__ import annotations

import os
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import checkfreq as cf
from checkfreq.ranks.collectives import GroupPeers
from checkfreq.ranks.compat import default_store
from checkfreq.ranks.groups import new_gloo_groups
from checkfreq.ranks.liveness import Liveness

FAILURE_TIMEOUT_S = 120.0
"""Far longer than the test may take: a rank named by its heartbeat's silence would fail it."""
RANKS = 4


def _all_gather_with_a_rank_killed(rank: int, store_path: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, RANKS), rank=rank, world_size=RANKS)
    _, (group,) = new_gloo_groups(["restore"], timedelta(seconds=600))
    liveness = Liveness(dist.PrefixStore("liveness", default_store()), rank, RANKS, FAILURE_TIMEOUT_S)
    peers = GroupPeers(group, liveness, "the restore's exchange")
    row = torch.full((4096,), rank, dtype=torch.uint8)
    gathered = peers.all_gather_rows(row)  # every rank has met every other
    assert gathered[:, 0].tolist() == list(range(RANKS))
    if rank == RANKS - 1:
        Path(out, "pid.tmp").write_text(str(os.getpid()))
        Path(out, "pid.tmp").rename(Path(out, "pid"))
        time.sleep(0.5)  # the others are in the next all-gather
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        peers.all_gather_rows(row)
    except cf.PeerLostError as e:
        Path(out, f"error{rank}").write_text(str(e))
    liveness.stop()
    os._exit(0)  # the job failed: no teardown of groups with a rank gone (its exit is armed, too)


def test_a_rank_killed_in_an_all_gather_is_named_by_every_survivor_without_the_failure_timeout(
    tmp_path: Path,
) -> None:
    """Rank 3 is SIGKILLed while every rank is in an all-gather; the survivors' errors name it, with its
    host and pid, as a process that ended, long before the failure timeout would have."""
    context = mp.get_context("spawn")
    ranks = [
        context.Process(target=_all_gather_with_a_rank_killed, args=(rank, str(tmp_path / "store"), str(tmp_path)))
        for rank in range(RANKS)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(FAILURE_TIMEOUT_S / 2)
    codes = [process.exitcode for process in ranks]
    for process in ranks:
        process.kill()
    assert codes == [0] * (RANKS - 1) + [-signal.SIGKILL], codes
    pid = (tmp_path / "pid").read_text()
    lost = f"rank {RANKS - 1} ({socket.gethostname()}, pid {pid}) ended (its process is gone)"
    for survivor in range(RANKS - 1):
        error = (tmp_path / f"error{survivor}").read_text()
        assert lost in error and "during the restore's exchange" in error, error
        assert f"rank {survivor} gives up" in error, error
