"""Other ranks' memory snapshots as this machine holds them: the regions of the ranks beside this
one, and the copies this machine keeps of other machines' ranks (``replicas=``), each made whole and
verified before it is used."""

from __future__ import annotations

import os

import torch

from checkfreq.errors import CheckfreqError
from checkfreq.pipeline.tiers.memory.replica_parts import whole
from checkfreq.pipeline.tiers.roles import HeldCopy
from checkfreq.storage.format import Manifest, entry_view
from checkfreq.storage.shm import MemoryRegion
from checkfreq.storage.shm_paths import device_and_inode, region_path, replica_path

_NOT_OF_IT = "none of that step and course (a step of another course is another state: docs/storage.md)"


def kept_copy(directory: str | os.PathLike[str], rank: int, step: int, course: int) -> HeldCopy:
    """The copy of rank ``rank``'s snapshot ``step`` of ``course`` this machine keeps, verified and
    made whole; a :class:`CheckfreqError` saying why if it cannot be read."""
    region = MemoryRegion(replica_path(directory, rank), device_and_inode(directory), tidy=False)
    try:
        found = region.newest(step, course)
    finally:
        region.release(remove=False)
    if found is None:
        why = "; ".join(reason for _, reason in region.skipped) or _NOT_OF_IT
        raise CheckfreqError(f"the copy of rank {rank}'s memory snapshot {step} kept here cannot be read: {why}")
    info, meta, data = found
    return whole(directory, HeldCopy(rank, step, meta, data, info.checksum, info.signature, course))


def share_on_machine(
    directory: str | os.PathLike[str], rank: int, step: int, course: int
) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Rank ``rank``'s share of memory snapshot ``step`` of ``course``, from its region on this machine,
    else from the copy this machine keeps of it; a :class:`CheckfreqError` naming the rank if neither has it."""
    reasons = []
    for what, path in (
        ("its region", region_path(directory, rank)),
        ("the copy kept here,", replica_path(directory, rank)),
    ):
        if not path.exists():
            continue
        region = MemoryRegion(path, device_and_inode(directory), tidy=False)
        try:
            found = region.newest(step, course)
            if found is not None:  # a copy kept here is made whole first (it may leave replicated pieces out)
                copy = whole(directory, HeldCopy(rank, step, found[1], found[2], found[0].checksum, b"", course))
                manifest = Manifest.from_json(copy.meta, step=step)
                return manifest, {name: entry_view(copy.data, entry) for name, entry in manifest.tensors.items()}
            reasons.append(f"{what} {path.name}: {'; '.join(r for _, r in region.skipped) or _NOT_OF_IT}")
        finally:
            region.release(remove=False)
    raise CheckfreqError(
        f"rank {rank}'s share of memory snapshot {step} is on no region of this machine "
        f"({os.uname().nodename})" + (f" ({'; '.join(reasons)})" if reasons else "")
    )
