"""What this rank has of one checkpoint at restore (:class:`Readable`): its manifest, the data files
its directory holds, the far tier that lists it, what rank 0 learns of it, and which saved ranks'
files this rank needs whole for the blocks it restores (:data:`Blocks`)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from checkfreq.pipeline.restore.messages import ALL_FILES, Holdings
from checkfreq.pipeline.restore.stream import ReplicatedStream
from checkfreq.ranks.rebuild import Box, chunk_holders, source_rank
from checkfreq.ranks.shares import SHARDED
from checkfreq.storage.format import Manifest

Blocks = Callable[[Manifest], dict[str, Box]]
"""The block of each sharded tensor of a checkpoint (its manifest) that this rank restores."""


@dataclass
class Readable:
    """What this rank has of one checkpoint: its manifest, the data files in its local directory
    (intact or not: reading them says), and the first far tier that lists it."""

    step: int
    manifest: Manifest
    held: set[str] | None
    """None on a rank that is not its directory's leader: the leader says what the directory holds."""
    far: str | None
    """The name of the first far tier (the remote tier) that lists it, if any."""

    @functools.cached_property
    def sharded(self) -> bool:
        """Whether the checkpoint holds sharded tensors (DTensors)."""
        return self.manifest.distributed is not None and any(
            entry["kind"] == SHARDED for entry in self.manifest.distributed["tensors"].values()
        )

    @functools.cached_property
    def stream(self) -> ReplicatedStream | None:
        """How the ranks all-gather its replicated pieces (None: they cannot; each gets every file)."""
        return ReplicatedStream.of(self.manifest)

    def holdings(self, page_cache: int | None, directory_leader: int, needs: list[int] | None) -> Holdings:
        """What rank 0 learns of it (``needs``: the saved ranks whose files this rank needs whole,
        None for every file)."""
        if self.held is None:
            held: str | list[str] | None = None
        else:
            held = ALL_FILES if len(self.held) == len(self.manifest.files) else sorted(self.held)
        files = json.dumps(self.manifest.files, sort_keys=True).encode()
        return Holdings(
            held, self.far is not None, page_cache, directory_leader, xxhash.xxh3_64_hexdigest(files), needs
        )

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
        assert self.manifest.distributed is not None  # a sharded checkpoint was written by ranks
        saved = self.manifest.distributed["tensors"]
        for name, box in blocks(self.manifest).items():
            entry = saved[name]
            if "chunked" in entry:
                needs.update(chunk_holders(entry["shape"], entry["chunked"], saved_world, box))
            elif saved_world != world_size:
                return None
        # at the same world size, a layout not recorded is taken for the saved one: checked once read
        return sorted(needs)
