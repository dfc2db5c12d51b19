"""Which ranks share a local checkpoint directory, learned at start in O(N) messages in all.

Each rank names its directory by a short key (:func:`directory_key`): on a file system known to be local to a machine,
the machine's boot id and the directory's device and inode (two containers on one machine see one
directory as one); on any other (NFS, Lustre, a FUSE mount: possibly the same directory on several
machines), the file-system type, the directory's resolved path and inode. Rank 0 gathers the
keys, takes as each directory's leader the lowest rank with its key, in one pass over
the list, and sends each rank its leader: a rank other than 0 sends and receives a few messages of
a few dozen bytes whatever the number of ranks.

A key can be wrong only on a file system that is not known to be local, so it is checked at
the cost of one file per directory: each leader drops a probe into its directory; each rank checks
that it sees its leader's probe (else it would wait for a staging directory no one creates), and
each leader that it sees no other leader's (else two ranks would commit into one directory). A
failed check raises on every rank.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

from checkfreq.errors import CheckfreqError
from checkfreq.ranks.collectives import Peers, collect_errors, gather_messages, scatter_messages
from checkfreq.ranks.group_share import groups_of, replica_ring
from checkfreq.ranks.messages import DirectoryKey, DirectoryLeader, GroupMembers
from checkfreq.storage.base import Store
from checkfreq.storage.local import LocalStore
from checkfreq.storage.shm_paths import region_path, shm_directory

LOCAL_FILE_SYSTEMS = frozenset(
    {
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "zfs",
        "f2fs",
        "jfs",
        "reiserfs",
        "tmpfs",
        "ramfs",
        "overlay",
        "vfat",
        "exfat",
        "ntfs",
        "ntfs3",
        "apfs",
        "hfs",
        "hfsplus",
    }
)
"""File-system types whose directories no other machine sees."""
_PROBE = ".checkfreq-probe-{token}-{rank:05d}"
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def directory_leader(local: Store, token: str, peers: Peers) -> int:
    """The lowest rank whose local directory is this rank's (see the module docstring). Collective.

    An object store is shared by every rank: rank 0 leads it.
    """
    if not isinstance(local, LocalStore):
        return 0
    keys = gather_messages(peers, DirectoryKey(directory_key(local.root)), DirectoryKey.from_wire)
    leaders = None if keys is None else [DirectoryLeader(r) for r in _leaders([k.key for k in keys])]
    leader = scatter_messages(peers, leaders, DirectoryLeader.from_wire).rank
    probe = local.root / _PROBE.format(token=token, rank=peers.rank)
    if leader == peers.rank:
        probe.write_bytes(b"")
    try:
        collect_errors(peers, None)  # every leader's probe is written
        problems = collect_errors(peers, _check_probes(local.root, token, peers.rank, leader))
    finally:
        probe.unlink(missing_ok=True)
    if problems:
        raise CheckfreqError(
            f"the ranks disagree on who shares a checkpoint directory ({'; '.join(problems)}); give every node its "
            "own local directory, or one directory every rank sees at once"
        )
    return leader


def memory_group(peers: Peers, key: str, copies: int = 0, stride: int = 1) -> GroupMembers:
    """The ranks that passed the same ``key`` (the memory tier's: this machine's shared memory and the
    run's region name), in rank order, and with ``copies`` (replicas, on the machines ``stride`` apart),
    where this rank copies its snapshots and whose it keeps
    (:func:`~checkfreq.ranks.group_share.replica_ring`). Collective: rank 0 gathers the keys and sends
    each rank its part, so a rank sends one key and receives its machine's ranks and its partners,
    whatever the number of ranks."""
    keys = gather_messages(peers, DirectoryKey(key), DirectoryKey.from_wire)
    members = None
    if keys is not None:
        groups = groups_of([k.key for k in keys])
        ring = replica_ring(groups, copies, stride)
        members = [GroupMembers(g, to, held) for g, (to, held) in zip(groups, ring, strict=True)]
    return scatter_messages(peers, members, GroupMembers.from_wire)


def memory_key(directory: str | os.PathLike[str], rank: int) -> str:
    """The key of :func:`memory_group`: the same on the ranks whose memory-tier regions of ``directory``
    share one machine's shared memory."""
    try:
        machine = directory_key(shm_directory())
    except OSError:  # no shared memory to share: this rank keeps its whole state
        machine = f"rank {rank}"
    return f"{machine}|{region_path(directory, 0).name}"


def _leaders(keys: list[str]) -> list[int]:
    """Each rank's directory leader: the lowest rank with its directory's key (one pass)."""
    first: dict[str, int] = {}
    return [first.setdefault(key, rank) for rank, key in enumerate(keys)]


def _check_probes(root: Path, token: str, rank: int, leader: int) -> str | None:
    """Why this rank's view of the probes contradicts the directory keys, or None."""
    if not (root / _PROBE.format(token=token, rank=leader)).exists():
        return f"rank {rank} does not see the directory of rank {leader}, which has the same identity"
    if leader == rank:
        probes = re.compile(re.escape(_PROBE.format(token=token, rank=0)[:-5]) + r"(\d+)$")
        others = sorted(
            int(m.group(1)) for p in root.iterdir() if (m := probes.match(p.name)) and int(m.group(1)) != rank
        )
        if others:
            return f"rank {rank} sees the directory of ranks {others}, whose identity differs"
    return None


def on_machine_local_file_system(path: Path) -> bool:
    """Whether ``path`` lies on a file system no other machine sees (so the ranks that share the
    directory share one page cache too)."""
    return file_system_type(path.resolve()) in LOCAL_FILE_SYSTEMS


def directory_key(path: Path) -> str:
    """A short key for the directory ``path``, the same on every rank that sees it (module docstring)."""
    resolved = path.resolve()
    stat = os.stat(resolved)
    kind = file_system_type(resolved)
    if kind in LOCAL_FILE_SYSTEMS:
        return f"{kind}:{machine_id()}:{stat.st_dev}:{stat.st_ino}"
    return f"{kind}:{stat.st_ino}:{resolved}"


def file_system_type(path: Path) -> str:
    """The type of the file system holding ``path`` (Linux's mount table), or ``"unknown"``."""
    best, kind = -1, "unknown"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                mount_point = _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
                fs_type = fields[fields.index("-") + 1]
                if _contains(mount_point, str(path)) and len(mount_point) > best:
                    best, kind = len(mount_point), fs_type
    except (OSError, ValueError, IndexError):
        return "unknown"
    return kind


def _contains(mount_point: str, path: str) -> bool:
    return path == mount_point or path.startswith(mount_point.rstrip("/") + "/")


def machine_id() -> str:
    """This machine's boot id (the same in every container on it), or its host name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()
