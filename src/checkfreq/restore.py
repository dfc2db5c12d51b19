"""Restore: the newest checkpoint every rank can read, found in any tier, read and verified.

The same code for one process and for N ranks (:mod:`checkfreq.collectives`). Each rank lists
the checkpoints whose manifest it can read (from its local directory or the remote tier) and which
of their data files its local directory holds; the ranks all-gather this. A checkpoint can be
restored if every rank can read its manifest and each data file is in some rank's directory or, for
each rank that lacks it, in the remote tier. The ranks take the newest such step. Each file a
directory holds is read from storage by one of the ranks holding it (they take turns, so on one
shared directory each rank reads about 1/N of the checkpoint), verified against the manifest's
checksum, and sent to the other ranks (node-local directories: no node reads another node's files
from the remote tier); a damaged copy is replaced by another directory's intact copy, and only what
no rank holds intact is read from the remote tier. If any rank fails, every rank moves on to the
next older common step.

With a memory tier, its newest snapshot every rank holds wins when it is not older than the
newest checkpoint listed on disk (it reads fastest); it is also the fallback when no checkpoint
on disk is valid.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from checkfreq.collectives import Peers, receive_json, send_json
from checkfreq.distributed_plan import complete
from checkfreq.errors import CorruptCheckpointError, NoValidCheckpointError
from checkfreq.format import Manifest, entry_view
from checkfreq.memory_tier import MemoryTier
from checkfreq.storage.base import Store
from checkfreq.storage.local import LocalStore, checkpoint_name

log = logging.getLogger("checkfreq.restore")

Skipped = list[tuple[str, str]]
"""(checkpoint or memory slot, why it was not restored)."""


@dataclass
class Found:
    """A checkpoint read for restore."""

    manifest: Manifest
    tensors: dict[str, torch.Tensor]
    name: str
    tier: str
    """``"local"``, ``"remote"``, ``"local+remote"`` (files read from each) or ``"memory"``."""
    skipped: Skipped = field(default_factory=list)


@dataclass
class _Readable:
    """What this rank has of one checkpoint: its manifest, the data files in its local directory
    (intact or not: reading them says), and whether the remote tier lists it."""

    step: int
    manifest: Manifest
    held: set[str]
    remote: bool

    def summary(self) -> dict[str, Any]:
        """What the other ranks learn of it (``"all"`` stands for every file: a shared directory)."""
        held = "all" if len(self.held) == len(self.manifest.files) else sorted(self.held)
        return {"held": held, "remote": self.remote}


class Restorer:
    """Finds and reads the checkpoint to restore, agreed by every rank.

    Args:
        local: this rank's directory (the only tier without ``remote``).
        remote: the durable tier, if any.
        peers: the ranks restoring together.
        memory: this rank's memory tier, if any.
        page_cache: ranks passing the same value read their directory through one page cache (a
            directory on a machine-local file system that they share: the lowest rank sharing it);
            None where each rank's reads go to storage (a network file system, an object store).
    """

    def __init__(self, local: Store, remote: Store | None, peers: Peers, memory: MemoryTier | None = None,
                 page_cache: int | None = None) -> None:
        self.local, self.remote, self.peers, self.memory = local, remote, peers, memory
        self.page_cache = page_cache
        self._locations: dict[str, dict[int, Any]] = {}

    def listed(self) -> list[int]:
        """Steps of the committed checkpoints either tier lists, newest first (not verified)."""
        steps = {s for s, _ in self.local.checkpoints()}
        if self.remote is not None:
            steps |= {s for s, _ in self.remote.checkpoints()}
        return sorted(steps, reverse=True)

    def find(self, step: int | None = None) -> Found | None:
        """The newest valid checkpoint (or the one at ``step``) every rank can read; None if no
        rank lists any; :class:`NoValidCheckpointError` if some exist but none is valid."""
        listed = [s for s in self.listed() if step is None or s == step]
        if self.memory is not None:
            found = self._from_memory(step, listed)
            if found is not None:
                return found
        try:
            return self._from_disk(step, listed)
        except NoValidCheckpointError:
            if self.memory is None:
                raise
            log.warning("no valid checkpoint on disk; trying older memory snapshots")
            found = self._from_memory(step, [])
            if found is None:
                raise
            return found

    # ------------------------------------------------------------------ memory

    def _from_memory(self, step: int | None, listed: list[int]) -> Found | None:
        """The newest memory snapshot every rank holds, unless disk lists a newer checkpoint."""
        assert self.memory is not None
        states, skipped = self.memory.read_all(step)
        by_step = {state.manifest.step: state for state in states}
        reports = self.peers.all_gather({"steps": sorted(by_step), "disk": listed[0] if listed else None})
        common = set.intersection(*(set(r["steps"]) for r in reports))
        disk = max((r["disk"] for r in reports if r["disk"] is not None), default=None)
        best = max(common, default=None)
        if best is None or (disk is not None and best < disk):
            if by_step and best is None:
                log.warning("memory tier: not every rank holds a valid snapshot; restoring from disk")
            return None
        state = by_step[best]
        return Found(state.manifest, state.tensors, state.name, "memory", skipped)

    # ------------------------------------------------------------------ disk

    def _from_disk(self, step: int | None, listed: list[int]) -> Found | None:
        self._locations = {"local": dict(self.local.checkpoints())}
        if self.remote is not None:
            self._locations["remote"] = dict(self.remote.checkpoints())
        mine: dict[int, _Readable] = {}
        problems: dict[int, str] = {}  # why this rank cannot read a listed step
        for s in listed:
            readable = self._readable(s)
            if isinstance(readable, str):
                problems[s] = readable
            else:
                mine[s] = readable
        reports = self.peers.all_gather({"steps": {str(s): r.summary() for s, r in mine.items()}, "listed": len(listed),
                                         "page_cache": self.page_cache})
        candidates: list[int] = []
        for s in mine:
            views = [r["steps"].get(str(s)) for r in reports]
            problem = _unreachable(mine[s].manifest, views) if None not in views else "another rank cannot read its manifest"
            if problem is not None:
                problems[s] = problem
            else:
                candidates.append(s)
        skipped: Skipped = []
        for s in sorted(candidates, reverse=True):  # the same steps on every rank: they depend on the reports only
            skipped += self._skip_newer_than(s, problems)
            problem = None
            try:
                found = self._read(mine[s], [r["steps"][str(s)] for r in reports], [r["page_cache"] for r in reports])
            except CorruptCheckpointError as e:
                problem = f"rank {self.peers.rank}: {e}" if self.peers.size > 1 else str(e)
            failed = [p for p in self.peers.all_gather(problem) if p]
            if not failed:
                found.skipped = skipped
                return found
            problems[s] = "; ".join(failed)
        skipped += self._skip_newer_than(-1, problems)
        if step is not None:
            raise NoValidCheckpointError(f"no valid checkpoint for step {step} in {self._where()}" + _reasons(skipped))
        if any(r["listed"] for r in reports):
            raise NoValidCheckpointError(f"no valid checkpoint in {self._where()}" + _reasons(skipped))
        return None

    @staticmethod
    def _skip_newer_than(step: int, problems: dict[int, str]) -> Skipped:
        """Log and take out the problems of the steps newer than ``step`` (those passed over to reach it)."""
        skipped = []
        for s in sorted((s for s in problems if s > step), reverse=True):
            why = problems.pop(s)
            log.warning("skipping checkpoint %s: %s", checkpoint_name(s), why)
            skipped.append((checkpoint_name(s), why))
        return skipped

    def _readable(self, step: int) -> _Readable | str:
        """How this rank can read checkpoint ``step``, or why it cannot."""
        local = self._locations["local"].get(step)
        remote = self._locations.get("remote", {}).get(step)
        manifest, problem = None, "no manifest"
        for store, location in ((self.local, local), (self.remote, remote)):
            if location is None or manifest is not None:
                continue
            try:
                manifest = store.read_manifest(location)  # type: ignore[union-attr]
            except CorruptCheckpointError as e:
                problem = str(e)
        if manifest is None:
            return problem
        held = set() if local is None else {name for name in manifest.files if self.local.file_size(local, name) is not None}
        return _Readable(step, manifest, held, remote is not None)

    def _read(self, readable: _Readable, views: list[dict[str, Any]], caches: list[int | None]) -> Found:
        """Read and verify every data file of a checkpoint, each file from storage by one rank only.

        Collective, in steps every rank takes in the same order: each file that some directory holds
        is read and verified by one of the ranks holding it (the holders take turns over the files,
        so on one shared directory each rank reads about 1/N of the checkpoint); the ranks hear which
        copies failed their checksum, and then every other holder of a damaged file checks its own
        copy. A rank that shares a page cache (``caches``) with a file's intact reader maps the same
        file, verified by that reader, without hashing it again; each file's reader (or the lowest
        holder of an intact copy) sends it to every other rank that has not read it (over the control
        group); last, each rank reads from the remote tier what no rank holds intact.
        """
        step, manifest = readable.step, readable.manifest
        locations = {tier: listing.get(step) for tier, listing in self._locations.items()}
        names = sorted(manifest.files)
        holders, checked = read_plan(names, views)
        """Who reads each file from storage: one holder (then, for a damaged copy, every holder)."""
        held = [None if view["held"] == "all" else set(view["held"]) for view in views]
        me = self.peers.rank
        files: dict[str, tuple[torch.Tensor, dict[str, Any]]] = {}
        damaged: dict[str, str] = {}
        self._read_local(locations["local"], [n for n in names if checked.get(n) == {me}], manifest, files, damaged)
        bad = [set(b) for b in self.peers.all_gather(sorted(damaged))]
        if any(bad):  # another directory may hold an intact copy: every holder checks its own
            retry = sorted(set().union(*bad))
            self._read_local(locations["local"], [n for n in retry if me in holders[n] and n not in damaged], manifest,
                             files, damaged)
            bad = [set(b) for b in self.peers.all_gather(sorted(damaged))]
            checked.update({n: set(holders[n]) for n in retry})
        for name in names:
            intact = sorted(r for r in checked.get(name, ()) if name not in bad[r])
            if not intact:
                continue  # from the remote tier, below
            readers, pages = set(intact), {caches[r] for r in intact} - {None}

            def maps(rank: int) -> bool:
                """``rank`` maps the file: its directory, which holds it, shares a page cache with a reader."""
                return caches[rank] in pages and (held[rank] is None or name in held[rank])  # noqa: B023

            if me == intact[0]:
                data, header = files[name]
                for receiver in (r for r in range(self.peers.size) if r not in readers and not maps(r)):
                    send_json(self.peers, {"header": header, "size": data.numel()}, receiver)
                    self.peers.send(data, receiver)
            elif me in readers:
                continue
            elif maps(me):
                files[name] = self._map_file(locations["local"], name, manifest.files[name])
            else:
                sent = receive_json(self.peers, intact[0])
                files[name] = (self.peers.receive(sent["size"], intact[0]), sent["header"])
                if name in damaged:
                    log.warning("checkpoint %s: local %s is damaged (%s); received rank %d's copy",
                                checkpoint_name(step), name, damaged[name], intact[0])
        used = {"local" if name in readable.held and name not in damaged else "peer" for name in files}
        for name, entry in manifest.files.items():
            if name in files:
                continue
            if locations.get("remote") is None:
                raise CorruptCheckpointError(damaged.get(name, f"data file {name} is neither in {self.local.root} nor in "
                                                                "another rank's directory, and no remote tier lists it"))
            if name in damaged:
                log.warning("checkpoint %s: local %s is damaged (%s); reading the remote copy", checkpoint_name(step), name,
                            damaged[name])
            files[name] = self._read_file("remote", locations["remote"], name, entry)
            used.add("remote")
        manifest, tensors = _views(manifest, files)
        return Found(manifest, tensors, checkpoint_name(step), "+".join(t for t in ("local", "peer", "remote") if t in used) or "local")

    def _read_local(self, location: Any, names: list[str], manifest: Manifest,
                    files: dict[str, tuple[torch.Tensor, dict[str, Any]]], damaged: dict[str, str]) -> None:
        """Read and verify ``names`` from this rank's directory into ``files``, or say in ``damaged`` why not."""
        for name in names:
            try:
                files[name] = self._read_file("local", location, name, manifest.files[name])
            except CorruptCheckpointError as e:
                damaged[name] = str(e)

    def _map_file(self, location: Any, name: str, entry: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        """A file of this rank's directory that a rank sharing its page cache verified."""
        assert isinstance(self.local, LocalStore)  # only a local directory shares a page cache
        return self.local.map_data(location, name, entry["size"], entry["xxh3_64"])

    def _read_file(self, tier: str, location: Any, name: str, entry: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        if location is None:
            raise CorruptCheckpointError(f"the {tier} tier no longer lists this checkpoint")
        store = self.local if tier == "local" else self.remote
        return store.read_data(location, name, entry["size"], entry["xxh3_64"])  # type: ignore[union-attr]

    def _where(self) -> str:
        return str(self.local.root) if self.remote is None else f"{self.local.root} or {self.remote.root}"


def read_plan(names: list[str], views: list[dict[str, Any]]) -> tuple[dict[str, list[int]], dict[str, set[int]]]:
    """For each data file in ``names``: the ranks whose directory holds it (``views``: every rank's
    :meth:`_Readable.summary`), and the one of them that reads it from storage (the holders take
    turns over the files). The same on every rank: it depends on the views only.

    O(N + the files the views list) per rank: the ranks that hold every file (a shared directory)
    are one list, shared by every file no other rank lists.
    """
    everyone = [r for r, view in enumerate(views) if view["held"] == "all"]
    some: dict[str, list[int]] = {}
    for r, view in enumerate(views):
        if view["held"] != "all":
            for name in view["held"]:
                some.setdefault(name, []).append(r)
    holders = {name: sorted(everyone + some[name]) if name in some else everyone for name in names}
    return holders, {name: {held[i % len(held)]} for i, (name, held) in enumerate(holders.items()) if held}


def _unreachable(manifest: Manifest, views: list[dict[str, Any]]) -> str | None:
    """Why some rank could get a data file from nowhere (``views``: every rank's
    :meth:`_Readable.summary`), or None. The same on every rank: it depends on the views only."""
    if any(view["held"] == "all" for view in views):
        return None  # a directory holds every file: every rank gets them from there
    held_by = Counter(name for view in views for name in view["held"])
    for name in sorted(manifest.files):
        if held_by[name]:
            continue
        stranded = [rank for rank, view in enumerate(views) if not view["remote"]]
        if stranded and len(views) == 1:
            return f"data file {name} is missing"
        if stranded:
            return f"data file {name} is in no rank's directory, and no remote tier lists the checkpoint for ranks {stranded}"
    return None


def _reasons(skipped: Skipped) -> str:
    return f" ({'; '.join(f'{name}: {why}' for name, why in skipped)})" if skipped else ""


def read_checkpoint(path: Any, store: Store | None = None) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Read and verify one checkpoint; return its manifest and tensors (CPU).

    ``path`` is a local checkpoint directory or, with ``store``, a location that ``store`` listed.
    Every file's checksum is verified before this returns. Tensors of a local checkpoint are
    views of a private, copy-on-write mapping of its files: nothing is copied until they are
    used, and writing to them never changes the checkpoint.
    """
    if store is None:
        path = Path(path)
        store = LocalStore(path.parent, create=False)
    manifest = store.read_manifest(path)
    files = {name: store.read_data(path, name, entry["size"], entry["xxh3_64"]) for name, entry in manifest.files.items()}
    return _views(manifest, files)


def _views(manifest: Manifest, files: dict[str, tuple[torch.Tensor, dict[str, Any]]]) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """The manifest completed from the files' headers (``files``: name → (data section, header)), and
    every stored array as a view of its file's data section."""
    manifest = complete(manifest, {name: header for name, (_, header) in files.items()})
    try:
        tensors = {name: entry_view(files[e["file"]][0], e) for name, e in manifest.tensors.items()}
    except RuntimeError as e:
        raise CorruptCheckpointError(f"manifest tensor index is inconsistent: {e}") from None
    return manifest, tensors
