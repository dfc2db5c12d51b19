"""What a copy of a memory snapshot on another machine carries (checkfreq.pipeline.tiers.memory.replica_parts): under
data parallelism, a rank's private bytes and its manifest, not its share of the replicated state; the
keeper checks what was sent, and makes the slot whole again from its own machine's regions, checked
against the sender's slot checksum. Two machines' regions in one process (two shared-memory
directories), as each machine's ranks take them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from checkfreq.cli import app
from checkfreq.errors import CheckfreqError
from checkfreq.pipeline.capture.snapshot import Snapshotter, layout_of
from checkfreq.pipeline.tiers.memory import replica_parts
from checkfreq.pipeline.tiers.memory.replica_parts import outgoing, pieces_of
from checkfreq.pipeline.tiers.memory.tier import MemoryTier
from checkfreq.pipeline.tiers.roles import SnapshotRequest
from checkfreq.policies.memory_cadence import MemoryCadence
from checkfreq.ranks.group_share import Group
from checkfreq.storage import parallel_hash
from checkfreq.storage.format import data_file_name
from checkfreq.storage.shm import MemoryRegion
from checkfreq.storage.shm_paths import SHM_DIR_ENV, device_and_inode, region_path, replica_path
from checkfreq.tools.catalog import memory_snapshots

STEP = 5
COURSE = 3
"""The course the machines' snapshots are taken in."""
FIRST, MINE = 1000, 3000
"""Elements of each rank's two private tensors (float32), laid before and after its replicated pieces."""


class _Module(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.big, self.small = torch.nn.Parameter(torch.randn(200, 50)), torch.nn.Parameter(torch.randn(7))


def _state(rank: int, module: _Module) -> dict[str, torch.Tensor]:
    return {
        "a/first": torch.full((FIRST,), float(rank)),
        "model/big": module.big.detach(),
        "model/small": module.small.detach(),
        "values/mine": torch.arange(MINE, dtype=torch.float32) + rank,
    }


def _machine(
    monkeypatch: pytest.MonkeyPatch,
    shm: Path,
    directory: Path,
    ranks: tuple[int, ...],
    module: _Module,
    state: Callable[[int, _Module], dict[str, torch.Tensor]] = _state,
) -> list[MemoryTier]:
    """The tiers of one machine's ranks of a job of 4, each with its snapshot of ``STEP`` committed."""
    shm.mkdir(exist_ok=True)
    monkeypatch.setenv(SHM_DIR_ENV, str(shm))
    tiers = []
    for rank in ranks:
        tier = MemoryTier(
            directory, MemoryCadence(1), data_file=data_file_name(0), rank=rank, group=Group(ranks, rank, 4)
        )
        tier.course = COURSE
        tensors, owned, split = tier.share(state(rank, module), set(), {"model": module}, {"rank": rank})
        layout = layout_of(tensors)
        target = tier.target(
            SnapshotRequest(layout, {"rank": rank}, STEP, 0, {}, 0.0, device_copies=False, sharded=False, split=split)
        )
        assert target is not None
        tier.commit(target, Snapshotter(False).take(tensors, set(), layout=layout, buffer=target.buffer, step=STEP))
        tiers.append(tier)
    return tiers


def _keep(directory: Path, sender: int, copy: replica_parts.Outgoing) -> None:
    """What the keeper does with a copy on the wire: its pieces into a slot, committed only if they match."""
    region = MemoryRegion(replica_path(directory, sender), device_and_inode(directory))
    region.reserve(copy.info.data_bytes, copy.info.meta_bytes)
    slot = region.begin()
    for into, piece in zip(pieces_of(slot.data, copy.info.data_bytes), copy.pieces(), strict=True):
        into.copy_(piece)
    info = copy.info
    region.commit(slot, info.step, info.data_bytes, copy.meta, info.signature, expect=info.checksum, course=info.course)
    region.release(remove=False)


@pytest.mark.parametrize("piece_bytes", [parallel_hash.CHUNK_BYTES, 4096])
def test_a_copy_carries_only_private_bytes_and_is_made_whole_where_it_is_kept(
    shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, piece_bytes: int
) -> None:
    """Rank 2 of machine B copies its snapshot to machine A: the copy carries its two private tensors
    and its manifest (its share of the replicated parameters is left out), passes the keeper's check
    (in 4 KiB pieces too, some gathered from two private tensors), and machine A's rank 0 makes it
    whole from its own region: the sender's slot, bit for bit, and its checksum."""
    monkeypatch.setattr(replica_parts, "REPLICA_PIECE_BYTES", piece_bytes)
    monkeypatch.setattr(parallel_hash, "CHUNK_BYTES", piece_bytes)  # the checksum's chunks, as the keeper's
    module = _Module()
    for tier in _machine(monkeypatch, shm_dir / "b", tmp_path, (2, 3), module):
        tier.close(remove=False)
    sender = MemoryRegion(region_path(tmp_path, 2), device_and_inode(tmp_path), tidy=False)
    info = sender.snapshots()[0]
    slot_data, slot_meta = (t.clone() if isinstance(t, torch.Tensor) else t for t in sender.slot_bytes(info))
    copy = outgoing(*sender.slot_bytes(info), info)  # views of the sender's region: released once sent

    assert copy.info.data_bytes == 4 * (FIRST + MINE)  # the private tensors: no replicated byte
    assert info.data_bytes > copy.info.data_bytes + 4 * 200 * 50 // 2 - 4 * 8  # its share of the parameters
    assert copy.info.step == STEP and copy.info.checksum != info.checksum

    tiers = _machine(monkeypatch, shm_dir / "a", tmp_path, (0, 1), module)
    _keep(tmp_path, 2, copy)
    sender.release(remove=False)
    own, copies = tiers[0].holdings()
    assert own == [(STEP, COURSE)] and copies == {2: [(STEP, COURSE)]}
    with pytest.raises(CheckfreqError, match="none of that step and course"):
        tiers[0].read_copy(2, (STEP, COURSE + 1))  # a step of another course is another state
    made = tiers[0].read_copy(2, (STEP, COURSE))
    assert made.meta == slot_meta and made.checksum == info.checksum and torch.equal(made.data, slot_data)
    listed = {s.name.rsplit(" slot", 1)[0]: s.valid for s in memory_snapshots(tmp_path)}  # checkfreq ls
    assert listed == {"memory rank 0": True, "memory rank 1": True, "memory copy of rank 2": True}, listed
    shown = CliRunner().invoke(app, ["ls", str(tmp_path)], env={"COLUMNS": "400"})
    assert f"every rank would resume from memory at step {STEP}, 0 steps" in shown.output, shown.output

    for tier in tiers:
        tier.close(remove=False)


def test_a_copy_no_region_here_can_make_whole_is_not_reported_nor_used(
    shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Machine A's share of the replicated state that rank 2's copy left out is damaged (or gone): the
    copy is not counted as usable while that share's manifest is missing, and reading it names what
    is missing instead of handing out a slot that is not the sender's."""
    module = _Module()
    for tier in _machine(monkeypatch, shm_dir / "b", tmp_path, (2, 3), module):
        tier.close(remove=False)
    sender = MemoryRegion(region_path(tmp_path, 2), device_and_inode(tmp_path), tidy=False)
    info = sender.snapshots()[0]
    copy = outgoing(*sender.slot_bytes(info), info)
    tiers = _machine(monkeypatch, shm_dir / "a", tmp_path, (0, 1), module)
    _keep(tmp_path, 2, copy)
    sender.release(remove=False)

    region = MemoryRegion(region_path(tmp_path, 0), device_and_inode(tmp_path), tidy=False)
    data, _ = region.slot_bytes(region.snapshots()[0])
    data[4 * FIRST + 8] = int(data[4 * FIRST + 8]) ^ 0xFF  # a byte of rank 0's replicated piece, flipped
    region.release(remove=False)
    with pytest.raises(
        CheckfreqError,
        match=r"the copy of rank 2's memory snapshot 5 left out replicated pieces "
        r"no region of this machine holds at that step \(e.g. 'model/big@",
    ):
        tiers[0].read_copy(2, (STEP, COURSE))

    replica_path(tmp_path, 0).unlink(missing_ok=True)
    region_path(tmp_path, 0).unlink()  # rank 0's region gone: its pieces are listed nowhere
    assert tiers[0].holdings()[1] == {2: []}  # the machine's first rank reports the copies kept there
    assert tiers[1].holdings()[1] == {}
    for tier in tiers:
        tier.close(remove=False)


def test_a_slot_without_a_long_run_of_replicated_pieces_goes_whole(
    shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below :data:`OMIT_MIN_BYTES` of replicated bytes in a row (an optimizer's step counters beside
    shards), the copy is the slot as it lies: its manifest and checksum, one view of its data."""
    monkeypatch.setattr(replica_parts, "OMIT_MIN_BYTES", 1 << 30)
    module = _Module()
    for tier in _machine(monkeypatch, shm_dir / "b", tmp_path, (2, 3), module):
        tier.close(remove=False)
    sender = MemoryRegion(region_path(tmp_path, 2), device_and_inode(tmp_path), tidy=False)
    info = sender.snapshots()[0]
    data, meta = sender.slot_bytes(info)
    copy = outgoing(data, meta, info)
    assert copy.info == info and copy.meta == meta
    (piece,) = copy.pieces()
    assert piece.data_ptr() == data.data_ptr() and piece.numel() == info.data_bytes
    sender.release(remove=False)


def test_a_copy_of_replicated_state_alone_carries_no_data_and_is_kept(
    shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank with no private tensor (DDP, ``rng=False``): its copy is its manifest alone, 0 bytes of
    data; the keeper still keeps it, and makes the sender's slot whole from its own region."""
    module = _Module()

    def replicated_only(rank: int, module: _Module) -> dict[str, torch.Tensor]:
        return {"model/big": module.big.detach(), "model/small": module.small.detach()}

    for tier in _machine(monkeypatch, shm_dir / "b", tmp_path, (2, 3), module, replicated_only):
        tier.close(remove=False)
    sender = MemoryRegion(region_path(tmp_path, 2), device_and_inode(tmp_path), tidy=False)
    info = sender.snapshots()[0]
    slot_data = sender.slot_bytes(info)[0].clone()
    copy = outgoing(*sender.slot_bytes(info), info)
    assert copy.info.data_bytes == 0 and list(copy.pieces()) == []
    tiers = _machine(monkeypatch, shm_dir / "a", tmp_path, (0, 1), module, replicated_only)
    _keep(tmp_path, 2, copy)
    sender.release(remove=False)
    made = tiers[0].read_copy(2, (STEP, COURSE))
    assert made.checksum == info.checksum and torch.equal(made.data, slot_data)
    for tier in tiers:
        tier.close(remove=False)
