"""What the machine can do with the same bytes: copy into preallocated memory, write+fsync, read."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from benchmarks.methods import Method, Sample, unlink
from benchmarks.states import State

CHUNK = 64 << 20


def scratch(state: State) -> torch.Tensor:
    """One flat buffer with all the state's bytes, shared by the limit measurements of a state.

    Shared, so a 2 GB state does not cost a copy per method (setup, not timed).
    """
    flat = getattr(state, "_scratch", None)
    if flat is None:
        flat = flat_copy(state.tensors)
        state._scratch = flat  # type: ignore[attr-defined]
    return flat


def flat_copy(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """All bytes of ``tensors`` in one flat ``uint8`` buffer (setup, not timed)."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    flat = torch.empty(total, dtype=torch.uint8)
    offset = 0
    for t in tensors.values():
        n = t.numel() * t.element_size()
        flat[offset : offset + n].copy_(t.contiguous().view(-1).view(torch.uint8))
        offset += n
    return flat


def write_fsync(path: Path, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for start in range(0, len(data), CHUNK):
            chunk = data[start : start + CHUNK]
            while chunk:
                chunk = chunk[os.write(fd, chunk) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cache(path: Path) -> None:
    """Evict a file's (clean) pages from the page cache, so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_cache(path: Path) -> None:
    """Read a file once so its pages are in the page cache (a file written with O_DIRECT is not)."""
    with open(path, "rb", buffering=0) as f:
        while f.read(CHUNK):
            pass


class RawCopy(Method):
    """``copy_`` of every state tensor into a preallocated buffer of its own shape."""

    name = "raw copy_ (preallocated)"
    kind = "limit"

    def setup(self, state: State, workdir: Path) -> None:
        flat, offset, self._pairs = scratch(state), 0, []
        for t in state.tensors.values():
            n = t.numel() * t.element_size()
            self._pairs.append((flat[offset : offset + n].view(t.dtype).view(t.shape), t))
            offset += n

    def run(self) -> Sample:
        start = time.perf_counter()
        with torch.no_grad():
            for dst, src in self._pairs:
                dst.copy_(src)
        return Sample(stall=time.perf_counter() - start)


class RawWrite(Method):
    """Sequential ``os.write`` of the state's bytes from memory (64 MiB chunks), then ``fsync``."""

    name = "raw write+fsync"
    kind = "limit"

    def setup(self, state: State, workdir: Path) -> None:
        self._flat = scratch(state)
        self._path = workdir / "raw.bin"

    def run(self) -> Sample:
        start = time.perf_counter()
        write_fsync(self._path, memoryview(self._flat.numpy()))
        elapsed = time.perf_counter() - start
        unlink(self._path)
        return Sample(stall=elapsed, durable=elapsed, nbytes=self._flat.numel())


class RawRead(Method):
    """``readinto`` a preallocated buffer, 64 MiB at a time, from the page cache (hot) or the disk (cold)."""

    kind = "limit"

    def __init__(self, cold: bool) -> None:
        self.cold = cold
        self.name = f"raw read ({'cold' if cold else 'hot'} cache)"

    def setup(self, state: State, workdir: Path) -> None:
        self._buffer = scratch(state)
        self._path = workdir / f"read-{'cold' if self.cold else 'hot'}.bin"
        write_fsync(self._path, memoryview(self._buffer.numpy()))

    def run(self) -> Sample:
        if self.cold:
            drop_cache(self._path)
        view = memoryview(self._buffer.numpy())
        start = time.perf_counter()
        with open(self._path, "rb", buffering=0) as f:
            for offset in range(0, len(view), CHUNK):
                f.readinto(view[offset : offset + CHUNK])
        return Sample(stall=time.perf_counter() - start, nbytes=len(view))

    def close(self) -> None:
        unlink(self._path)
