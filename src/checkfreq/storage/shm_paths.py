"""Where the memory tier's shared-memory regions live: the directory that holds them
(``$CHECKFREQ_SHM_DIR`` or ``/dev/shm``), the file of each rank's region and of the copy a
machine keeps of another's (its replica), both named after the checkpoint directory, and the
identity of that directory a region records (:mod:`checkfreq.storage.shm` maps the files).
"""

from __future__ import annotations

import os
from pathlib import Path

import xxhash

SHM_DIR_ENV = "CHECKFREQ_SHM_DIR"
DEFAULT_SHM_DIR = "/dev/shm"


def shm_directory() -> Path:
    """Where regions live: ``$CHECKFREQ_SHM_DIR`` or ``/dev/shm``."""
    return Path(os.environ.get(SHM_DIR_ENV) or DEFAULT_SHM_DIR)


def region_path(directory: str | os.PathLike[str], rank: int) -> Path:
    """The region of checkpoint ``directory`` (a path or URL) for ``rank``."""
    key = str(directory) if "://" in str(directory) else os.path.abspath(directory)
    return shm_directory() / f"checkfreq-{xxhash.xxh3_64(key.encode()).hexdigest()}-rank{rank:05d}"


def replica_path(directory: str | os.PathLike[str], rank: int) -> Path:
    """Where this machine keeps the copies of rank ``rank``'s snapshots of checkpoint ``directory``
    (its replicas, sent from another machine)."""
    return region_path(directory, rank).with_name(region_path(directory, rank).name.replace("-rank", "-replica"))


def device_and_inode(directory: str | os.PathLike[str]) -> tuple[int, int]:
    """(st_dev, st_ino) of a local directory, (0, 0) for a URL: a region written for a directory
    that was since deleted and re-created belongs to another run and is never restored."""
    if "://" in str(directory):
        return (0, 0)
    st = os.stat(directory)
    return (st.st_dev, st.st_ino)
