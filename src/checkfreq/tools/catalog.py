"""Checkpoints as a user sees them from a shell: listing with validity, verification and
inspection (:mod:`checkfreq.tools.export` writes one as a plain state dict,
:mod:`checkfreq.tools.diff` compares two).

Everything here reads through a :class:`~checkfreq.storage.Store` (a local directory or any
fsspec URL) and :func:`checkfreq.read_checkpoint`; nothing unpickles. The
``checkfreq`` command only formats what these functions return.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from checkfreq.errors import (
    CheckfreqError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    NoValidCheckpointError,
)
from checkfreq.pipeline.restore import read_checkpoint
from checkfreq.pipeline.tiers.memory.replica_parts import manifest_bytes
from checkfreq.ranks.rebuild import check_assembles
from checkfreq.storage import Store, open_store
from checkfreq.storage.format import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    checkpoint_name,
    data_file_name,
    typed_checkpoint_step,
)
from checkfreq.storage.local import LocalStore
from checkfreq.storage.shm_listing import listed_regions


@dataclass(frozen=True)
class CheckpointRef:
    """One checkpoint: the store holding it and its location there."""

    store: Store
    location: Any

    @property
    def name(self) -> str:
        return self.location.name

    @property
    def address(self) -> str:
        """A path for a local checkpoint, else ``URL/step_N``."""
        if isinstance(self.store, LocalStore):
            return str(self.location)
        return f"{str(self.store.root).rstrip('/')}/{self.name}"

    def read_manifest(self) -> Manifest:
        return self.store.read_manifest(self.location)

    def read(self) -> tuple[Manifest, dict[str, torch.Tensor]]:
        """The verified manifest and tensors."""
        return read_checkpoint(self.location, self.store)


@dataclass(frozen=True)
class CheckpointStatus:
    """One committed checkpoint and whether a restore would accept it."""

    name: str
    path: str
    step: int
    epoch: int | None
    bytes: int
    """Bytes of its files: on disk for a local directory, as the manifest lists them for a URL."""
    created: float | None
    """When it was written (seconds since the epoch), from its manifest; None if unreadable."""
    valid: bool
    reason: str | None
    """Why it is invalid (None when valid)."""
    checksummed: bool
    """Whether validity includes reading every byte against its checksum (else: manifest and sizes)."""
    tier: str = "disk"
    """``"disk"`` (the directory or URL) or ``"memory"`` (a snapshot in this node's shared memory)."""
    elsewhere: list[int] = field(default_factory=list)
    """Ranks whose data files are not in this directory (a node-local directory holds its node's
    ranks' files only) and were not checked: no remote tier was given to check them in."""
    set_aside: str | None = None
    """Its name now if it is set aside: as damaged (by a restore that skipped it, or by ``checkfreq
    verify``), or as of a course the run left (by a run that went on from an older step;
    :func:`checkfreq.tools.aside.set_aside_statuses` lists them); None while it is listed."""
    damaged_here: bool = field(default=False, repr=False)
    """Invalid for damage in its own store (not for what the remote tier lacks): what may be set aside."""

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        del record["damaged_here"]
        return record


def is_url(target: str | os.PathLike[str]) -> bool:
    text = os.fspath(target)
    return "://" in text and not text.startswith("file://")


def names_checkpoint(target: str | os.PathLike[str]) -> bool:
    """True if ``target`` names one checkpoint (``…/step_N`` or a directory with a manifest), False for a run."""
    name = os.fspath(target).rstrip("/").rsplit("/", 1)[-1]
    return typed_checkpoint_step(name) is not None or (not is_url(target) and (Path(target) / MANIFEST_NAME).is_file())


def resolve_checkpoint(target: str | os.PathLike[str]) -> CheckpointRef:
    """The checkpoint ``target`` names: ``RUN/step_N`` (N unpadded is fine; a path or a URL), a
    local checkpoint directory, or, for a run, its newest valid checkpoint (checksums verified)."""
    if names_checkpoint(target):
        return _named_checkpoint(target)
    invalid = []
    for status, ref in _statuses(open_store(target, create=False), checksums=True):
        if status.valid:
            return ref
        invalid.append(f"{status.name}: {status.reason}")
    if not invalid:
        raise NoValidCheckpointError(f"{target} holds no checkpoint")
    raise NoValidCheckpointError(f"no valid checkpoint in {target} ({'; '.join(invalid)})")


def _named_checkpoint(target: str | os.PathLike[str]) -> CheckpointRef:
    text = os.fspath(target).rstrip("/")
    parent, _, name = text.rpartition("/")
    typed = typed_checkpoint_step(name)
    if not is_url(text):
        path = Path(text)
        if not path.exists() and typed is not None:
            path = path.with_name(checkpoint_name(typed))
        if not path.is_dir():
            raise CheckpointNotFoundError(f"{target} is neither a checkpoint nor a run directory")
        return CheckpointRef(LocalStore(path.parent, create=False), path)
    store = open_store(parent, create=False)
    for step, location in store.checkpoints():
        if step == typed:
            return CheckpointRef(store, location)
    raise NoValidCheckpointError(f"{target} is not a committed checkpoint (no manifest there)")


def list_checkpoints(
    root: str | os.PathLike[str] | Store, *, checksums: bool = True, remote: str | os.PathLike[str] | None = None
) -> list[CheckpointStatus]:
    """Every checkpoint the run at ``root`` (a path, a URL or a store) lists, newest first, with its validity
    (those set aside as damaged are not listed: :func:`checkfreq.tools.aside.set_aside_statuses`).

    With ``checksums=False`` only the manifest and (for a local directory) the file sizes are
    checked; no data is read. A checkpoint written by several ranks into node-local directories
    has in ``root`` only the files of that node's ranks: the others are checked in ``remote`` (the
    job's remote tier) if given, else listed in :attr:`CheckpointStatus.elsewhere`.
    """
    tier = None if remote is None else open_store(remote, create=False)
    return [status for status, _ in _statuses(open_store(root, create=False), checksums=checksums, remote=tier)]


def memory_snapshots(root: str | os.PathLike[str], *, checksums: bool = True) -> list[CheckpointStatus]:
    """The memory tier's snapshots of the run at ``root`` on this node, newest first, with their validity:
    its ranks' (``memory rank R slot S``) and the copies it keeps of other nodes' (``memory copy of rank R``).

    With ``checksums=False`` only the slot headers are checked. Nothing is changed or removed.
    """
    found = []
    regions = [(kind, rank, region) for kind in ("rank", "replica") for rank, region in listed_regions(root, kind)]
    for kind, rank, region in regions:
        try:
            for info in region.snapshots():
                manifest, valid, reason = None, True, None
                try:
                    manifest = (
                        Manifest.from_json(manifest_bytes(region.read(info)[0]), step=info.step) if checksums else None
                    )
                except CheckfreqError as e:
                    valid, reason = False, str(e)
                found.append(
                    CheckpointStatus(
                        name=f"memory {'rank' if kind == 'rank' else 'copy of rank'} {rank} slot {info.slot}",
                        path=str(region.path),
                        step=info.step,
                        epoch=manifest.epoch if manifest else None,
                        bytes=info.data_bytes,
                        created=manifest.created if manifest else None,
                        valid=valid,
                        reason=reason,
                        checksummed=checksums,
                        tier="memory",
                    )
                )
        finally:
            region.release(remove=False)
    return sorted(found, key=lambda s: -s.step)


def _statuses(
    store: Store, *, checksums: bool, remote: Store | None = None
) -> Iterator[tuple[CheckpointStatus, CheckpointRef]]:
    links = store.linked_checkpoints() if isinstance(store, LocalStore) else []
    for step, location in store.checkpoints():
        while links and links[0][0] > step:
            yield _linked(store, *links.pop(0))
        ref = CheckpointRef(store, location)
        yield check_checkpoint(ref, checksums=checksums, remote=remote), ref
    for link in links:
        yield _linked(store, *link)


def _linked(store: Store, step: int, path: Path, target: str) -> tuple[CheckpointStatus, CheckpointRef]:
    """A ``step_N`` entry that is a symbolic link: never a checkpoint (a restore never reads it), and
    no damage of the run's to set aside."""
    status = CheckpointStatus(
        name=path.name,
        path=str(path),
        step=step,
        epoch=None,
        bytes=0,
        created=None,
        valid=False,
        reason=f"a symbolic link (to {target}), not a checkpoint directory: never restored",
        checksummed=False,
    )
    return status, CheckpointRef(store, path)


def check_checkpoint(ref: CheckpointRef, *, checksums: bool = True, remote: Store | None = None) -> CheckpointStatus:
    """The status of one checkpoint; never raises for a damaged checkpoint.

    A local checkpoint of several ranks that lacks some ranks' files (a node-local directory) is
    checked with the files it holds; the others are checked in ``remote`` if given, else named in
    :attr:`CheckpointStatus.elsewhere`.
    """
    typed = typed_checkpoint_step(ref.name)
    step, manifest, elsewhere = (-1 if typed is None else typed), None, []
    try:
        manifest = ref.read_manifest()
        step = manifest.step
        absent = _absent_files(ref, manifest)
        if not absent:
            if checksums:
                check_assembles(*ref.read())  # its index puts every tensor together, as a restore reads it
            elif isinstance(ref.store, LocalStore):
                _check_sizes(ref.location, manifest)
        else:
            elsewhere = _check_node_files(ref, manifest, absent, checksums, remote)
        valid, reason, here = True, None, False
    except CorruptCheckpointError as e:
        valid, reason, here = False, str(e), not isinstance(e, _RemoteProblem)
    except OSError as e:
        valid, reason, here = False, f"unreadable: {e}", False
    return CheckpointStatus(
        name=ref.name,
        path=ref.address,
        step=step,
        epoch=manifest.epoch if manifest else None,
        bytes=checkpoint_bytes(ref, manifest),
        created=manifest.created if manifest else None,
        valid=valid,
        reason=reason,
        checksummed=checksums,
        elsewhere=elsewhere,
        damaged_here=here,
    )


class _RemoteProblem(CorruptCheckpointError):
    """What a node-local directory's checkpoint lacks in the remote tier: no damage of its own."""


def _absent_files(ref: CheckpointRef, manifest: Manifest) -> list[str]:
    """The data files of a checkpoint that belong in another node's directory: the manifest records
    which ranks wrote into one directory (``distributed["directories"]``: each rank's directory
    leader), and this directory is the one of the ranks whose files it holds. A file of this
    directory's ranks that is missing is not absent but lost (checking it says so)."""
    directories = (manifest.distributed or {}).get("directories")
    if (
        not isinstance(ref.store, LocalStore)
        or not isinstance(directories, list)
        or len(directories) != manifest.world_size
    ):
        return []
    files = [data_file_name(rank) for rank in range(manifest.world_size)]
    here = {directories[rank] for rank, name in enumerate(files) if ref.store.file_size(ref.location, name) is not None}
    if not here:
        raise CorruptCheckpointError("none of its data files is in this directory")
    return [name for rank, name in enumerate(files) if directories[rank] not in here]


def _check_node_files(
    ref: CheckpointRef, manifest: Manifest, absent: list[str], checksums: bool, remote: Store | None
) -> list[int]:
    """Check the files a node-local directory holds, and the others in ``remote`` if given; return
    the ranks whose files were not checked."""
    remote_location = None
    if remote is not None:
        remote_location = dict(remote.checkpoints()).get(manifest.step)
        if remote_location is None:
            raise _RemoteProblem(
                f"data files {', '.join(absent)} are not in this directory, "
                f"and {remote.root} does not list the checkpoint"
            )
    for name, entry in manifest.files.items():
        store, location = (ref.store, ref.location) if name not in absent else (remote, remote_location)
        if store is None:
            continue
        try:
            if checksums:
                store.read_data(location, name, entry["size"], entry["xxh3_64"])
            elif (size := store.file_size(location, name)) != entry["size"]:
                where = "in this directory" if store is ref.store else f"in {store.root}"
                has = "is missing" if size is None else f"has {size} bytes, manifest says {entry['size']}"
                raise CorruptCheckpointError(f"data file {name} {where} {has}")
        except CorruptCheckpointError as e:
            raise (e if store is ref.store else _RemoteProblem(str(e))) from None
    if remote is not None:
        return []
    return sorted(rank for rank in range(manifest.world_size) if data_file_name(rank) in absent)


def _check_sizes(path: Path, manifest: Manifest) -> None:
    for name, entry in manifest.files.items():
        try:
            actual = (path / name).stat().st_size
        except FileNotFoundError:
            raise CorruptCheckpointError(f"data file {name} is missing") from None
        if actual != entry["size"]:
            raise CorruptCheckpointError(f"data file {name} has {actual} bytes, manifest says {entry['size']}")


def checkpoint_bytes(ref: CheckpointRef, manifest: Manifest | None) -> int:
    """Bytes of a checkpoint: its files on disk (a local directory), else its data files as ``manifest`` lists them."""
    if not isinstance(ref.store, LocalStore):
        return sum(entry["size"] for entry in manifest.files.values()) if manifest else 0
    try:
        return sum(e.stat().st_size for e in os.scandir(ref.location) if e.is_file(follow_symlinks=False))
    except OSError:
        return 0


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint, from its manifest."""

    name: str
    shape: list[int]
    dtype: str
    bytes: int
    file: str


@dataclass(frozen=True)
class CheckpointDescription:
    """What ``checkfreq inspect`` shows: the manifest's contents, without reading the data."""

    path: str
    step: int
    epoch: int | None
    world_size: int
    created: float
    versions: dict[str, str]
    files: dict[str, FileEntry]
    tensors: list[TensorInfo]
    objects: dict[str, dict[str, Any]]
    """Registered name → {"tensors": count, "bytes": total, "value": the plain value, if it holds no tensor}."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def describe(ref: CheckpointRef) -> CheckpointDescription:
    """Read a checkpoint's manifest and summarise tensors, objects and versions. The data is not
    read, but for a checkpoint written by several ranks, whose files' headers hold each rank's part:
    then its files are read and verified."""
    manifest = ref.read_manifest()
    if not manifest.complete:
        manifest, _ = ref.read()
    tensors = [
        TensorInfo(name, list(e["shape"]), e["dtype"], e["offsets"][1] - e["offsets"][0], e["file"])
        for name, e in sorted(manifest.tensors.items())
    ]
    objects: dict[str, dict[str, Any]] = {}
    for name, node in manifest.state.items():
        owned = [t for t in tensors if t.name == name or t.name.startswith(f"{name}/")]
        entry: dict[str, Any] = {"tensors": len(owned), "bytes": sum(t.bytes for t in owned)}
        if not owned and not _has_marker(node):
            entry["value"] = node
        objects[name] = entry
    return CheckpointDescription(
        path=ref.address,
        step=manifest.step,
        epoch=manifest.epoch,
        world_size=manifest.world_size,
        created=manifest.created,
        versions=manifest.versions,
        files=manifest.files,
        tensors=tensors,
        objects=objects,
    )


def _has_marker(node: Any) -> bool:
    if isinstance(node, list):
        return any(_has_marker(v) for v in node)
    if isinstance(node, dict):
        return any(k.startswith("__") and k.endswith("__") for k in node) or any(_has_marker(v) for v in node.values())
    return False
