"""The replicated tensors of a checkpoint as one byte stream, and how the ranks all-gather it.

Under DDP every data file holds a piece of the replicated state (parameters, optimizer state). At
restore each rank reads a few files and puts each file's range of the stream in a row; the ranks
all-gather the rows, and every rank cuts the stream back into whole tensors. A rank receives about
the size of the replicated state, at any number of ranks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from checkfreq.errors import CorruptCheckpointError
from checkfreq.ranks.shares import REPLICATED, cuts, stream_range
from checkfreq.storage.format import DTYPES_BY_CODE, Manifest, data_file_rank, header_entries


@dataclass(frozen=True)
class ReplicatedStream:
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
    def of(cls, manifest: Manifest) -> ReplicatedStream | None:
        """The stream of a checkpoint written by several ranks (None for one written by one process,
        or a version 1 manifest). O(T + N log T): no piece of any other file is listed."""
        if manifest.complete:
            return None
        assert manifest.distributed is not None  # an incomplete manifest was written by ranks
        try:
            shared = manifest.distributed["tensors"]
            replicated = sorted((n, e) for n, e in shared.items() if e["kind"] == REPLICATED)
            sizes = tuple((n, math.prod(e["shape"]), DTYPES_BY_CODE[e["dtype"]].itemsize) for n, e in replicated)
        except (KeyError, TypeError, AttributeError):
            return None
        tensors, start = [], 0
        for (name, entry), (_, numel, itemsize) in zip(replicated, sizes, strict=True):
            tensors.append((name, entry["dtype"], tuple(entry["shape"]), start))
            start += numel * itemsize
        return cls(tuple(tensors), sizes, tuple(cuts(sizes, manifest.world_size)))

    @property
    def width(self) -> int:
        """A row's length: a file index (8 bytes) and the longest file's range, in whole 8-byte words."""
        longest = max(b - a for a, b in zip(self.cuts, self.cuts[1:], strict=False))
        return 8 + -(-longest // 8) * 8

    def empty_row(self) -> torch.Tensor:
        """A row that holds no file (index −1), for a rank with fewer files read than the rounds."""
        out = torch.zeros(self.width, dtype=torch.uint8)
        out[:8].view(torch.int64)[0] = -1
        return out

    def row(self, name: str, data: torch.Tensor, header: dict[str, Any]) -> torch.Tensor:
        """The row of the verified data file ``name`` (its data section and header): its index and
        its range of the stream, taken from its pieces."""
        out = torch.zeros(self.width, dtype=torch.uint8)
        k = data_file_rank(name)
        out[:8].view(torch.int64)[0] = k
        index = header_entries(header, name)
        codes = {n: code for n, code, _, _ in self.tensors}
        offset = 8
        for piece in stream_range(self.sizes, self.cuts[k], self.cuts[k + 1]):
            entry = index.get(piece.stored_name)
            begin, end, fits = 0, 0, False
            if entry is not None:
                try:
                    begin, end = entry["offsets"]
                    fits = entry["dtype"] == codes[piece.name] and math.prod(entry["shape"]) == piece.end - piece.begin
                except (TypeError, ValueError):
                    fits = False
            if not fits or not 0 <= begin <= end <= data.numel():
                raise CorruptCheckpointError(f"data file {name} does not hold {piece.stored_name} as its manifest says")
            out[offset : offset + end - begin] = data[begin:end]
            offset += end - begin
        if offset - 8 != self.cuts[k + 1] - self.cuts[k]:
            raise CorruptCheckpointError(
                f"data file {name} holds {offset - 8} bytes of replicated tensors, not the "
                f"{self.cuts[k + 1] - self.cuts[k]} its manifest says"
            )
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
            raise CorruptCheckpointError(
                f"the ranks' rows hold files {sorted(index.tolist())[:8]}…, not each of the {files} once"
            )
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
        assert manifest.distributed is not None  # a stream is made of a checkpoint written by ranks
        shared = dict(manifest.distributed["tensors"])
        for name, _, shape, _ in self.tensors:
            shared[name] = {**shared[name], "parts": [[name, 0, math.prod(shape)]]}
        return dataclasses.replace(manifest, distributed={**manifest.distributed, "tensors": shared})
