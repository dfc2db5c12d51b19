"""Restore: the newest checkpoint every rank can read, found in any tier, read and verified.

The same code for one process and for N ranks (:mod:`checkfreq.dist.collectives`), in rounds that rank
0 leads, so that a rank other than 0 sends and receives a few small messages at any number of ranks:

1. Rank 0 gathers the steps each rank lists (in its local directory or the remote tier) and the
   ranks try the steps every rank lists, newest first.
2. For a step, each rank reads that checkpoint's manifest (no other) and tells rank 0 which data
   files its local directory holds and whether the remote tier lists the checkpoint. Rank 0 checks
   that every file can be had and gives each file one reader: one of the ranks whose directory
   holds it (they take turns, so on one shared directory each rank reads about 1/N of the
   checkpoint) or, for a file no directory holds, a rank that reads it from the remote tier.
3. The readers read and verify their files. A damaged copy goes to a holder in another directory,
   then to the remote tier; every byte read from storage is verified once, by its reader.
4. Each rank gets what it needs from the readers: whole, the data file of the saved rank whose
   private state it restores (its own at the same world size) and, under FSDP2, those holding the
   shards its live blocks overlap (its own at the same layout; at another world size, the few
   whose ``torch.chunk`` blocks meet its own, as the manifest records the layout); and,
   all-gathered over the control group, the replicated tensors (parameters and optimizer state
   under DDP) of every other file: about the size of the replicated state per rank, at any number
   of ranks. A rank whose directory shares its page cache with a file's reader maps the file
   rather than receive it. Each rank checks that the shards it got cover its blocks; if they do
   not on some rank (a layout the manifest does not record), the ranks take the step again, each
   getting every file. When every rank shares one page cache (one machine, one directory), or the
   checkpoint has a version 1 manifest, every rank gets every file whole at once.

If any rank fails, every rank moves on to the next older step. With node-local directories no node
reads another node's files from the remote tier: only what no directory holds intact comes from it.

With a memory tier, its newest snapshot every rank holds wins when it is not older than the
newest checkpoint listed on disk (it reads fastest); it is also the fallback when no checkpoint
on disk is valid.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import xxhash

from checkfreq.dist.collectives import Peers, collect_errors, receive_json, scatter_json, send_json
from checkfreq.dist.shares import (
    REPLICATED,
    SHARDED,
    Box,
    chunk_holders,
    complete,
    cuts,
    source_rank,
    stream_range,
    uncovered,
)
from checkfreq.errors import CorruptCheckpointError, NoValidCheckpointError
from checkfreq.pipeline.memory_tier import MemoryTier
from checkfreq.storage.base import Store
from checkfreq.storage.format import DTYPES_BY_CODE, Manifest, data_file_name, entry_view, header_entries
from checkfreq.storage.local import LocalStore, checkpoint_name

log = logging.getLogger("checkfreq.restore")

Skipped = list[tuple[str, str]]
"""(checkpoint or memory slot, why it was not restored)."""
Files = dict[str, tuple[torch.Tensor, dict[str, Any]]]
"""Data files a rank holds whole: name → (verified data section, parsed header)."""
Blocks = Callable[[Manifest], dict[str, Box]]
"""The block of each sharded tensor of a checkpoint (its manifest) that this rank restores."""


@dataclass
class Found:
    """A checkpoint read for restore."""

    manifest: Manifest
    tensors: dict[str, torch.Tensor]
    name: str
    tier: str
    """Where this rank's data came from: ``"local"``, ``"peer"`` (other ranks), ``"remote"``, joined
    with ``+`` (``"local+peer"``), or ``"memory"``."""
    skipped: Skipped = field(default_factory=list)


@dataclass
class _Readable:
    """What this rank has of one checkpoint: its manifest, the data files in its local directory
    (intact or not: reading them says), and whether the remote tier lists it."""

    step: int
    manifest: Manifest
    held: set[str] | None
    """None on a rank that is not its directory's leader: the leader says what the directory holds."""
    remote: bool

    @functools.cached_property
    def sharded(self) -> bool:
        """Whether the checkpoint holds sharded tensors (DTensors)."""
        return self.manifest.distributed is not None and any(
            entry["kind"] == SHARDED for entry in self.manifest.distributed["tensors"].values())

    @functools.cached_property
    def stream(self) -> _Stream | None:
        """How the ranks all-gather its replicated pieces (None: they cannot; each gets every file)."""
        return _Stream.of(self.manifest)

    def summary(self, page_cache: int | None, directory: int, needs: list[int] | None) -> dict[str, Any]:
        """What rank 0 learns of it (``"all"`` stands for every file: a shared directory; ``needs``:
        the saved ranks whose files this rank needs whole, None for every file)."""
        if self.held is None:
            held: str | list[str] | None = None
        else:
            held = "all" if len(self.held) == len(self.manifest.files) else sorted(self.held)
        files = json.dumps(self.manifest.files, sort_keys=True).encode()
        return {"held": held, "remote": self.remote, "cache": page_cache, "dir": directory,
                "files": xxhash.xxh3_64_hexdigest(files), "needs": needs}

    def needs(self, rank: int, world_size: int, blocks: Blocks | None) -> list[int] | None:
        """The saved ranks whose data files rank ``rank`` of ``world_size`` needs whole besides the
        replicated tensors: the one whose private state it restores, and those whose shards its
        ``blocks`` overlap. None: every file (a sharded tensor laid out in a way not recorded, at
        another world size, or no ``blocks`` given)."""
        saved_world = self.manifest.world_size
        needs = {source_rank(rank, saved_world)}
        if not self.sharded:
            return sorted(needs)
        if blocks is None:
            return None
        saved = self.manifest.distributed["tensors"]  # type: ignore[index]
        for name, box in blocks(self.manifest).items():
            entry = saved[name]
            if "chunked" in entry:
                needs.update(chunk_holders(entry["shape"], entry["chunked"], saved_world, box))
            elif saved_world != world_size:
                return None
        return sorted(needs)  # at the same world size, a layout not recorded is taken for the saved one: checked once read


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
        directory: ranks passing the same value share one local directory (its lowest rank; the
            default: this rank's own).
    """

    def __init__(self, local: Store, remote: Store | None, peers: Peers, memory: MemoryTier | None = None,
                 page_cache: int | None = None, directory: int | None = None) -> None:
        self.local, self.remote, self.peers, self.memory = local, remote, peers, memory
        self.page_cache = page_cache
        self.directory = peers.rank if directory is None else directory
        self._locations: dict[str, dict[int, Any]] = {}
        self._blocks: Blocks | None = None

    def listed(self) -> list[int]:
        """Steps of the committed checkpoints either tier lists, newest first (not verified)."""
        steps = {s for s, _ in self.local.checkpoints()}
        if self.remote is not None:
            steps |= {s for s, _ in self.remote.checkpoints()}
        return sorted(steps, reverse=True)

    def find(self, step: int | None = None, blocks: Blocks | None = None) -> Found | None:
        """The newest valid checkpoint (or the one at ``step``) every rank can read; None if no
        rank lists any; :class:`NoValidCheckpointError` if some exist but none is valid.

        ``blocks`` gives the blocks of the sharded tensors this rank restores: with it a rank gets
        only the files that hold them (its own, when the layout is the saved one); without it, every
        rank gets every file of a checkpoint with sharded tensors.
        """
        self._blocks = blocks
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
        reports = self.peers.gather({"steps": sorted(by_step), "disk": listed[0] if listed else None})
        best, common = self.peers.broadcast(None if reports is None else _memory_choice(reports))
        if best is None:
            if by_step and not common:
                log.warning("memory tier: not every rank holds a valid snapshot; restoring from disk")
            return None
        state = by_step[best]
        return Found(state.manifest, state.tensors, state.name, "memory", skipped)

    # ------------------------------------------------------------------ disk

    def _from_disk(self, step: int | None, listed: list[int]) -> Found | None:
        self._locations = {"local": dict(self.local.checkpoints())}
        if self.remote is not None:
            self._locations["remote"] = dict(self.remote.checkpoints())
        lists = self.peers.gather(listed)
        agenda = self.peers.broadcast(None if lists is None else _agenda(lists))
        problems = {int(s): why for s, why in agenda["passed"]}
        skipped: Skipped = []
        for s in agenda["steps"]:  # the same steps on every rank, in the same order
            skipped += self._skip_newer_than(s, problems)
            found = self._restore_step(s)
            if isinstance(found, Found):
                found.skipped = skipped
                return found
            problems[s] = found
        skipped += self._skip_newer_than(-1, problems)
        if step is not None:
            raise NoValidCheckpointError(f"no valid checkpoint for step {step} in {self._where()}" + _reasons(skipped))
        if agenda["listed"]:
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
        if self.directory != self.peers.rank:
            held = None  # one rank of a directory looks: the others would repeat its N lookups
        else:
            held = set() if local is None else {name for name in manifest.files if self.local.file_size(local, name) is not None}
        return _Readable(step, manifest, held, remote is not None)

    def _restore_step(self, step: int, own_shards: bool = True) -> Found | str:
        """Checkpoint ``step`` read, verified and shared as rank 0 plans it, or why it cannot be.

        Collective: every rank sends rank 0 its summary, then takes rank 0's orders (read these
        files; again after a damaged copy; then what to map, receive and send) until rank 0 says
        the step fails or the files are all verified. With ``own_shards``, a rank may get only the
        files of a checkpoint with sharded tensors that hold its blocks (:meth:`_Readable.needs`); if
        their shards then do not cover them, on any rank, the ranks take the step again, each
        getting every file.
        """
        readable = self._readable(step)
        if isinstance(readable, str):
            summary: str | dict[str, Any] = readable
        else:
            needs = readable.needs(self.peers.rank, self.peers.size, self._blocks if own_shards else None)
            summary = readable.summary(self.page_cache, self.directory, needs)
        views = self.peers.gather(summary)
        plan = None if views is None else _Plan.of(readable, views)
        if isinstance(plan, str):
            order = scatter_json(self.peers, [{"problem": plan}] * self.peers.size)
        else:
            order = scatter_json(self.peers, None if plan is None else plan.orders())
        files: Files = {}
        packs: dict[str, torch.Tensor] = {}
        tiers: set[str] = set()
        while "read" in order:
            assert isinstance(readable, _Readable)
            damaged = self._read_assigned(readable, order, files, packs, tiers)
            reports = self.peers.gather(damaged)
            order = scatter_json(self.peers, None if reports is None else plan.after(reports))  # type: ignore[union-attr]
        if "problem" in order:
            return order["problem"]
        assert isinstance(readable, _Readable)
        problem, found, short = None, None, None
        check = order["partial"] and readable.sharded  # the same on every rank
        try:
            found = self._exchange(readable, order, files, packs, tiers)
            if check:
                assert self._blocks is not None  # rank 0 plans a sharded checkpoint so only then
                short = next(iter(uncovered(found.manifest, self._blocks(readable.manifest))), None)
        except CorruptCheckpointError as e:
            problem = f"rank {self.peers.rank}: {e}" if self.peers.size > 1 else str(e)
        if not check:
            failed = collect_errors(self.peers, problem)
        else:
            failed, short_of = self._outcome(problem, short)
            if short_of is not None:
                if self.peers.rank == 0:
                    log.info("checkpoint %s: the data files rank %d got do not hold all of its block of %s (the "
                             "shards were laid out otherwise); every rank gets every file", checkpoint_name(step), *short_of)
                return self._restore_step(step, own_shards=False)
        return "; ".join(failed) if failed else found  # type: ignore[return-value]

    def _outcome(self, problem: str | None, short: str | None) -> tuple[list[str], list[Any] | None]:
        """Every rank's error, and the first rank whose files fall short of its blocks with the
        tensor (``short``: this rank's first such, or None), the same on every rank: one gather and
        its broadcast, as :func:`~checkfreq.dist.collectives.collect_errors`."""
        gathered = self.peers.gather([problem, short])
        if gathered is None:
            return self.peers.broadcast(None)
        first = next(([rank, name] for rank, (_, name) in enumerate(gathered) if name is not None), None)
        return self.peers.broadcast([[e for e, _ in gathered if e], first])

    def _read_assigned(self, readable: _Readable, order: dict[str, Any], files: Files, packs: dict[str, torch.Tensor],
                       tiers: set[str]) -> dict[str, str]:
        """Read and verify the files ``order`` gives this rank (packing their replicated pieces if
        it says so); return why each damaged one is."""
        stream = readable.stream if order["pack"] else None
        damaged = {}
        for name, tier in order["read"]:
            try:
                files[name] = self._read_file(tier, self._locations[tier].get(readable.step), name, readable.manifest.files[name])
                if stream is not None:
                    packs[name] = stream.row(name, *files[name])
                tiers.add(tier)
            except CorruptCheckpointError as e:
                files.pop(name, None)
                damaged[name] = str(e)
                log.warning("checkpoint %s: %s copy of %s is damaged (%s)", checkpoint_name(readable.step),
                            "the remote" if tier == "remote" else "this rank's", name, e)
        return damaged

    def _exchange(self, readable: _Readable, order: dict[str, Any], files: Files, packs: dict[str, torch.Tensor],
                  tiers: set[str]) -> Found:
        """Send and receive the whole files ``order`` says, all-gather the replicated pieces if it
        says so, map the files a reader verified in the page cache this rank shares; then this
        rank's manifest and stored arrays."""
        step, manifest = readable.step, readable.manifest
        position = {name: i for i, name in enumerate(sorted(manifest.files))}
        me = self.peers.rank
        operations = sorted([(position[name], to, name, None) for name, to in order["send"]]
                            + [(position[name], me, name, sender) for name, sender in order["receive"]])
        for _, to, name, sender in operations:  # one order on every rank: each pair meets in turn
            if sender is None:
                data, header = files[name]
                send_json(self.peers, {"header": header, "size": data.numel()}, to)
                self.peers.send(data, to)
            else:
                sent = receive_json(self.peers, sender)
                files[name] = (self.peers.receive(sent["size"], sender), sent["header"])
                tiers.add("peer")
        replicated: dict[str, torch.Tensor] = {}
        if order["stream"]:
            stream = readable.stream
            assert stream is not None  # rank 0 streams only a checkpoint written by several ranks
            mine = [packs[name] for name in sorted(packs)]
            rows = torch.cat([self.peers.all_gather_rows(mine[r] if r < len(mine) else stream.row(None))
                              for r in range(order["stream"])])
            replicated = stream.tensors_of(rows)
            manifest = stream.whole(manifest)
            if len(packs) < len(manifest.files):
                tiers.add("peer")
        for name in order["map"]:
            files[name] = self._map_file(self._locations["local"].get(step), name, manifest.files[name])
            tiers.add("local")
        manifest, stored = _views(manifest, files, partial=order["partial"])
        stored.update(replicated)
        used = "+".join(t for t in ("local", "peer", "remote") if t in tiers) or "local"
        return Found(manifest, stored, checkpoint_name(step), used)

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


def _memory_choice(reports: list[dict[str, Any]]) -> tuple[int | None, bool]:
    """Rank 0's choice of memory snapshot: the newest step every rank holds unless disk lists a newer
    one (or None), and whether every rank holds some step."""
    common = set.intersection(*(set(r["steps"]) for r in reports))
    disk = max((r["disk"] for r in reports if r["disk"] is not None), default=None)
    best = max(common, default=None)
    if best is not None and disk is not None and best < disk:
        best = None
    return best, bool(common)


def _agenda(lists: list[list[int]]) -> dict[str, Any]:
    """Rank 0's agenda from every rank's listed steps: the steps every rank lists, newest first, and
    why each other step is passed over."""
    count = Counter(s for steps in lists for s in set(steps))
    passed = []
    for s, n in count.items():
        if n < len(lists):
            first = next(r for r, steps in enumerate(lists) if s not in steps)
            passed.append([s, f"{len(lists) - n} of {len(lists)} ranks list no such checkpoint (rank {first} first)"])
    every = sorted((s for s, n in count.items() if n == len(lists)), reverse=True)
    return {"steps": every, "passed": passed, "listed": bool(count)}


class _Plan:
    """Rank 0's plan for one checkpoint: who reads each data file from which tier, after a damaged
    copy who reads it next, and then who gets which file from whom.

    O(N + files) to make (but for what every rank gets whole, every file in the modes that give
    every rank every file); a rank's orders name the files it reads, maps, receives and sends.
    """

    def __init__(self, readable: _Readable, views: list[dict[str, Any]]) -> None:
        manifest = readable.manifest
        self.manifest, self.views = manifest, views
        self.names = sorted(manifest.files)
        self.holders, checked = read_plan(self.names, views)
        self.reader = {name: next(iter(ranks)) for name, ranks in checked.items()}
        self.tier = dict.fromkeys(self.reader, "local")
        self.tried = {name: {views[r]["dir"] for r in ranks} for name, ranks in checked.items()}
        self.remote_ranks = [r for r, view in enumerate(views) if view["remote"]]
        self.load = Counter(self.reader.values())
        self._to_remote([name for name in self.names if name not in self.reader])
        caches = {view["cache"] for view in views}
        one_cache = len(caches) == 1 and None not in caches and all(view["held"] == "all" for view in views)
        self.lean = not one_cache and readable.stream is not None and all(view["needs"] is not None for view in views)
        """Each rank gets the files it needs whole and the replicated tensors all-gathered, not every file."""
        self.streamed = self.lean and bool(readable.stream.tensors)  # type: ignore[union-attr]
        """The ranks all-gather the replicated tensors (a lean plan, and the checkpoint has some)."""
        self.fresh = set(self.names)
        """The files whose reader has not read them yet."""

    @classmethod
    def of(cls, readable: _Readable | str, views: list[Any]) -> _Plan | str:
        """The plan, or why the ranks cannot restore this checkpoint."""
        for rank, view in enumerate(views):
            if isinstance(view, str):
                return f"rank {rank} cannot read its manifest: {view}" if len(views) > 1 else view
        assert isinstance(readable, _Readable)
        differs = next((r for r, view in enumerate(views) if view["files"] != views[0]["files"]), None)
        if differs is not None:
            return f"rank {differs}'s manifest lists other data files than rank 0's"
        for view in views:
            if view["held"] is None:  # what its directory's leader found there
                view["held"] = views[view["dir"]]["held"]
        return _unreachable(readable.manifest, views) or cls(readable, views)

    def _to_remote(self, names: list[str]) -> None:
        """Give each of ``names`` a reader of the remote tier, the least busy first."""
        ranks = sorted(self.remote_ranks, key=lambda r: (self.load[r], r))
        for i, name in enumerate(names):
            reader = ranks[i % len(ranks)]
            self.reader[name], self.tier[name] = reader, "remote"
            self.load[reader] += 1

    def orders(self) -> list[dict[str, Any]] | str:
        """Every rank's next orders, in rank order."""
        reads: list[list[list[str]]] = [[] for _ in self.views]
        for name in sorted(self.fresh):
            reads[self.reader[name]].append([name, self.tier[name]])
        self.fresh = set()
        return [{"read": read, "pack": self.streamed} for read in reads]

    def after(self, reports: list[dict[str, str]]) -> list[dict[str, Any]]:
        """The orders once every rank said which of its files were damaged (``reports``)."""
        to_remote = []
        for rank, damaged in enumerate(reports):
            for name, why in damaged.items():
                no_copy_left = [{"problem": f"rank {rank}: {why}" if len(reports) > 1 else why}] * len(reports)
                if self.tier[name] == "remote":
                    return no_copy_left
                if not self._next_holder(name):  # no other directory holds it: the remote tier, if listed
                    if not self.remote_ranks:
                        return no_copy_left
                    to_remote.append(name)
                self.fresh.add(name)
        self._to_remote(to_remote)
        return self.orders() if self.fresh else self._exchange_orders()

    def _next_holder(self, name: str) -> bool:
        """Give ``name`` to a holder in a directory not tried yet, if there is one."""
        for rank in self.holders[name]:
            if self.views[rank]["dir"] not in self.tried[name]:
                self.tried[name].add(self.views[rank]["dir"])
                self.reader[name] = rank
                return True
        return False

    def _exchange_orders(self) -> list[dict[str, Any]]:
        """What each rank maps, receives and sends, in how many rounds it all-gathers the replicated
        pieces, and whether it gets only some files (``partial``)."""
        rounds = max(Counter(self.reader.values()).values()) if self.streamed else 0  # the most files a rank read
        orders: list[dict[str, Any]] = [{"map": [], "receive": [], "send": [], "stream": rounds, "partial": self.lean}
                                        for _ in self.views]
        held: dict[int, set[str]] = {}
        for rank, order in enumerate(orders):
            needs = [data_file_name(k) for k in self.views[rank]["needs"]] if self.lean else self.names
            for name in needs:
                reader = self.reader[name]
                if reader == rank:
                    continue
                view = self.views[rank]
                holds = view["held"] == "all" or name in held.setdefault(rank, set(view["held"]))
                if holds and self.tier[name] == "local" and view["cache"] is not None and view["cache"] == self.views[reader]["cache"]:
                    order["map"].append(name)
                else:
                    order["receive"].append([name, reader])
                    orders[reader]["send"].append([name, rank])
        return orders


@dataclass(frozen=True)
class _Stream:
    """The replicated tensors of a checkpoint as one byte stream (laid end to end in name order, as
    the plan that wrote them split it), and how the ranks all-gather it: in rounds, each rank a row
    per round holding the index of a file it read and that file's range of the stream, so that the
    rows sorted by file index and cut to their lengths are the stream."""

    tensors: tuple[tuple[str, str, tuple[int, ...], int], ...]
    """(name, dtype code, shape, first byte in the stream) of each replicated tensor."""
    sizes: tuple[tuple[str, int, int], ...]
    """(name, numel, itemsize) of each, as the plan takes them."""
    cuts: tuple[int, ...]
    """File ``k`` holds bytes ``[cuts[k], cuts[k + 1])`` of the stream."""

    @classmethod
    def of(cls, manifest: Manifest) -> _Stream | None:
        """The stream of a checkpoint written by several ranks (None for one written by one process,
        or a version 1 manifest). O(T + N log T): no piece of any other file is listed."""
        if manifest.complete:
            return None
        try:
            replicated = sorted((n, e) for n, e in manifest.distributed["tensors"].items() if e["kind"] == REPLICATED)  # type: ignore[union-attr]
            sizes = tuple((n, math.prod(e["shape"]), DTYPES_BY_CODE[e["dtype"]].itemsize) for n, e in replicated)
        except (KeyError, TypeError, AttributeError):
            return None
        tensors, start = [], 0
        for (name, entry), (_, numel, itemsize) in zip(replicated, sizes):
            tensors.append((name, entry["dtype"], tuple(entry["shape"]), start))
            start += numel * itemsize
        return cls(tuple(tensors), sizes, tuple(cuts(sizes, manifest.world_size)))

    @property
    def width(self) -> int:
        """A row's length: a file index (8 bytes) and the longest file's range, in whole 8-byte words."""
        longest = max(b - a for a, b in zip(self.cuts, self.cuts[1:]))
        return 8 + -(-longest // 8) * 8

    def row(self, name: str | None, data: torch.Tensor | None = None, header: dict[str, Any] | None = None) -> torch.Tensor:
        """The row of the verified data file ``name`` (its data section and header): its index and
        its range of the stream, taken from its pieces; with no file, index −1."""
        out = torch.zeros(self.width, dtype=torch.uint8)
        if name is None:
            out[:8].view(torch.int64)[0] = -1
            return out
        k = _file_index(name)
        out[:8].view(torch.int64)[0] = k
        index = header_entries(header or {}, name)
        codes = {n: code for n, code, _, _ in self.tensors}
        offset = 8
        for piece in stream_range(self.sizes, self.cuts[k], self.cuts[k + 1]):
            entry = index.get(piece.stored_name)
            try:
                begin, end = entry["offsets"]  # type: ignore[index]
                fits = entry["dtype"] == codes[piece.name] and math.prod(entry["shape"]) == piece.end - piece.begin  # type: ignore[index]
            except (TypeError, ValueError):
                fits = False
            if not fits or not 0 <= begin <= end <= data.numel():  # type: ignore[union-attr]
                raise CorruptCheckpointError(f"data file {name} does not hold {piece.stored_name} as its manifest says")
            out[offset : offset + end - begin] = data[begin:end]  # type: ignore[index]
            offset += end - begin
        if offset - 8 != self.cuts[k + 1] - self.cuts[k]:
            raise CorruptCheckpointError(f"data file {name} holds {offset - 8} bytes of replicated tensors, not the "
                                         f"{self.cuts[k + 1] - self.cuts[k]} its manifest says")
        return out

    def tensors_of(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every replicated tensor, whole, from the all-gathered ``rows`` (one per file read, and
        rows of index −1), in vectorised steps whatever the number of files."""
        index = rows.view(torch.int64)[:, 0]
        rows = rows[index >= 0]
        index = index[index >= 0]
        files = len(self.cuts) - 1
        order = torch.argsort(index)
        if not torch.equal(index[order], torch.arange(files)):
            raise CorruptCheckpointError(f"the ranks' rows hold files {sorted(index.tolist())[:8]}…, not each of the {files} once")
        lengths = torch.tensor(self.cuts[1:]) - torch.tensor(self.cuts[:-1])
        mask = torch.arange(self.width - 8).unsqueeze(0) < lengths.unsqueeze(1)
        stream = rows[order][:, 8:][mask]
        out = {}
        for name, code, shape, start in self.tensors:
            dtype = DTYPES_BY_CODE[code]
            flat = stream[start : start + math.prod(shape) * dtype.itemsize]
            out[name] = (flat if start % dtype.itemsize == 0 else flat.clone()).view(dtype).view(shape)
        return out

    def whole(self, manifest: Manifest) -> Manifest:
        """``manifest`` with each replicated tensor recorded as one whole part (as :meth:`tensors_of` gives them)."""
        shared = dict(manifest.distributed["tensors"])  # type: ignore[index]
        for name, _, shape, _ in self.tensors:
            shared[name] = {**shared[name], "parts": [[name, 0, math.prod(shape)]]}
        return dataclasses.replace(manifest, distributed={**manifest.distributed, "tensors": shared})  # type: ignore[dict-item]


def _file_index(name: str) -> int:
    """The rank that wrote the data file ``name`` (``rank00003.safetensors``: 3)."""
    return int(name[len("rank") :].split(".")[0])


def read_plan(names: list[str], views: list[dict[str, Any]]) -> tuple[dict[str, list[int]], dict[str, set[int]]]:
    """For each data file in ``names``: the ranks whose directory holds it (``views``: every rank's
    :meth:`_Readable.summary`), and the one of them that reads it from storage (the holders take
    turns over the files). A file no directory holds has no holder and no reader.

    O(N + the files the views list): the ranks that hold every file (a shared directory) are one
    list, shared by every file no other rank lists.
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
    """Why no rank can get some data file (``views``: every rank's :meth:`_Readable.summary`), or None."""
    if any(view["held"] == "all" for view in views) or any(view["remote"] for view in views):
        return None  # a directory holds every file, or some rank reads what no directory holds from the remote tier
    held_by = {name for view in views for name in view["held"]}
    missing = next((name for name in sorted(manifest.files) if name not in held_by), None)
    if missing is None:
        return None
    if len(views) == 1:
        return f"data file {missing} is missing"
    return f"data file {missing} is in no rank's directory, and no remote tier lists the checkpoint"


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


def _views(manifest: Manifest, files: Files, partial: bool = False) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """The manifest completed from the files' headers (``files``: name → (data section, header); with
    ``partial``, some of them: the other ranks' parts stay unknown), and every stored array of
    ``files`` as a view of its file's data section."""
    manifest = complete(manifest, {name: header for name, (_, header) in files.items()}, partial=partial)
    try:
        tensors = {name: entry_view(files[e["file"]][0], e) for name, e in manifest.tensors.items()}
    except RuntimeError as e:
        raise CorruptCheckpointError(f"manifest tensor index is inconsistent: {e}") from None
    return manifest, tensors
