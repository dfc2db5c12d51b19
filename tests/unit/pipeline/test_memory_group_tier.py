"""The memory tiers of one machine's ranks, in one process: each keeps its share of a snapshot in its
own region; a rank puts the state together from its share and the others' regions, refuses a
damaged share naming its rank, and skips shares taken by another set of ranks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from checkfreq.errors import CheckfreqError
from checkfreq.pipeline.capture.snapshot import Snapshotter, layout_of
from checkfreq.pipeline.tiers.memory.tier import MemoryTier
from checkfreq.pipeline.tiers.roles import SnapshotRequest
from checkfreq.policies.memory_cadence import MemoryCadence
from checkfreq.ranks.group_share import Group
from checkfreq.ranks.rebuild import local_view
from checkfreq.storage.format import data_file_name
from checkfreq.storage.shm import MemoryRegion
from checkfreq.storage.shm_paths import device_and_inode, region_path, replica_path


class _Module(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.big, self.small = torch.nn.Parameter(torch.randn(200, 50)), torch.nn.Parameter(torch.randn(7))


def _state(rank: int, module: _Module) -> dict[str, torch.Tensor]:
    return {
        "model/big": module.big.detach(),
        "model/small": module.small.detach(),
        "values/mine": torch.full((3,), float(rank)),
    }


def _snapshot(tier: MemoryTier, rank: int, module: _Module, step: int) -> None:
    tensors, owned, split = tier.share(_state(rank, module), set(), {"model": module}, {"rank": rank})
    layout = layout_of(tensors)
    target = tier.target(
        SnapshotRequest(layout, {"rank": rank}, step, 0, {}, 0.0, device_copies=False, sharded=False, split=split)
    )
    assert target is not None
    tier.commit(target, Snapshotter(False).take(tensors, set(), layout=layout, buffer=target.buffer, step=step))


def _tiers(directory: Path, ranks: tuple[int, ...], world_size: int) -> list[MemoryTier]:
    return [
        MemoryTier(
            directory, MemoryCadence(1), data_file=data_file_name(0), rank=rank, group=Group(ranks, rank, world_size)
        )
        for rank in ranks
    ]


def test_a_rank_puts_its_state_together_from_its_machines_regions(shm_dir: Path, tmp_path: Path) -> None:
    module = _Module()
    tiers = _tiers(tmp_path, (0, 1, 2), 3)
    for rank, tier in enumerate(tiers):
        _snapshot(tier, rank, module, step=5)
    sizes = [
        MemoryRegion(region_path(tmp_path, r), device_and_inode(tmp_path), tidy=False).snapshots()[0].data_bytes
        for r in range(3)
    ]
    assert max(sizes) < 200 * 50 * 4 / 3 * 1.1  # each region holds about a third of the parameters
    for rank, tier in enumerate(tiers):
        (state,), skipped = tier.snapshots()
        assert not skipped
        whole = tier.complete(state)
        skeleton, tensors = local_view(whole.manifest, whole.tensors)
        assert skeleton == {"rank": rank}
        expected = _state(rank, module)
        assert tensors.keys() == expected.keys()
        assert all(torch.equal(tensors[n], expected[n]) for n in expected)
    for tier in tiers:
        tier.close(remove=False)

    # rank 2's share damaged after its owner committed it: rank 0 names it and restores nothing from it
    region = MemoryRegion(region_path(tmp_path, 2), device_and_inode(tmp_path), tidy=False)
    info = region.snapshots()[0]
    with open(region.path, "r+b") as f:
        at = 4096 + info.slot * (region.nbytes - 4096) // 2 + 10
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    region.release(remove=False)
    tier = _tiers(tmp_path, (0, 1, 2), 3)[0]
    (state,), _ = tier.snapshots()
    with pytest.raises(CheckfreqError, match=r"rank 2's share of memory snapshot 5 .*fails its checksum"):
        tier.complete(state)
    tier.close(remove=False)


def test_shares_restore_at_another_world_size_from_the_machines_regions(shm_dir: Path, tmp_path: Path) -> None:
    """Replicated and private state taken by ranks 0 and 1 of a job of 4 (a node lost since, or the job
    shrunk to one process): each rank that runs here now puts its state together from both regions."""
    module = _Module()
    for rank, tier in enumerate(_tiers(tmp_path, (0, 1), 4)):
        _snapshot(tier, rank, module, step=3)
        tier.close(remove=False)
    for tier, rank in [
        (_tiers(tmp_path, (0, 1), 2)[1], 1),
        (MemoryTier(tmp_path, MemoryCadence(1), data_file=data_file_name(0)), 0),
    ]:
        (state,), skipped = tier.snapshots()
        assert not skipped
        whole = tier.complete(state)
        skeleton, tensors = local_view(whole.manifest, whole.tensors)
        expected = _state(rank, module)
        assert skeleton == {"rank": rank} and all(torch.equal(tensors[n], expected[n]) for n in expected)
        tier.close(remove=False)


def test_a_share_whose_region_is_gone_is_read_from_its_replica_unless_damaged(shm_dir: Path, tmp_path: Path) -> None:
    """Rank 1's region lost with its node, a copy of it kept here (``replicas=``): rank 0 reads the
    copy; with a byte of the copy flipped, it names rank 1 and the copy, and reads nothing from it."""
    module = _Module()
    for rank, tier in enumerate(_tiers(tmp_path, (0, 1), 2)):
        _snapshot(tier, rank, module, step=5)
        tier.close(remove=False)
    shutil.move(region_path(tmp_path, 1), replica_path(tmp_path, 1))
    tier = _tiers(tmp_path, (0, 1), 2)[0]
    (state,), _ = tier.snapshots()
    whole = tier.complete(state)
    skeleton, tensors = local_view(whole.manifest, whole.tensors)
    assert all(torch.equal(tensors[n], t) for n, t in _state(0, module).items())
    copy = MemoryRegion(replica_path(tmp_path, 1), device_and_inode(tmp_path), tidy=False)
    info = copy.snapshots()[0]
    data, _ = copy.slot_bytes(info)
    data[3] ^= 0xFF
    copy.release(remove=False)
    with pytest.raises(
        CheckfreqError,
        match=r"rank 1's share of memory snapshot 5 is on no region of this machine "
        r"\(.+\) \(the copy kept here, checkfreq-\w+-replica00001: slot \d "
        r"\(step 5\) fails its checksum",
    ):
        tier.complete(state)
    tier.close(remove=False)
