"""The memory tier's regions of one checkpoint directory on this node: listed (for the CLI and the
restore), and those of ranks a smaller job lacks removed."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from checkfreq.storage.shm import MemoryRegion
from checkfreq.storage.shm_paths import device_and_inode, region_path, shm_directory

log = logging.getLogger("checkfreq.shm")


def remove_regions_beyond(directory: str | os.PathLike[str], world_size: int) -> list[Path]:
    """Delete the regions of ranks that a job of ``world_size`` ranks no longer has (an earlier
    job on the directory ran with more); returns what was removed. Rank 0 calls it at start."""
    removed = []
    for rank, region in listed_regions(directory):
        if rank >= world_size:
            log.info("removing shared-memory region %s: this job has %d ranks", region.path, world_size)
            region.release(remove=True)
            removed.append(region.path)
    return removed


def listed_regions(directory: str | os.PathLike[str], kind: str = "rank") -> list[tuple[int, MemoryRegion]]:
    """The regions of checkpoint ``directory`` on this node, by rank (read-only look, for the CLI);
    with ``kind="replica"``, the copies this node keeps of other nodes' ranks' snapshots."""
    prefix = region_path(directory, 0).name.rsplit("-rank", 1)[0] + f"-{kind}"
    found = []
    for path in sorted(shm_directory().glob(prefix + "*")):
        try:
            rank = int(path.name[len(prefix) :])
        except ValueError:
            continue
        found.append((rank, MemoryRegion(path, device_and_inode(directory), tidy=False)))
    return found
