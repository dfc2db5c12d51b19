"""Data sections are written with O_DIRECT when buffer and file offset are block-aligned, and
normally otherwise; either way the file holds exactly the bytes given."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from pathlib import Path

import pytest
import torch
import xxhash

import checkfreq.storage.posix
from checkfreq.pipeline.capture.snapshot import aligned_empty
from checkfreq.storage.format import BLOCK_BYTES, data_chunks
from checkfreq.storage.posix import write_chunks, write_data_file

PAGE = mmap.PAGESIZE
direct_io = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")


def _cached_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (``mincore`` on a mapping of it)."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        pages = (size + PAGE - 1) // PAGE
        residency = ctypes.create_string_buffer(pages)
        assert libc.mincore(address, size, residency) == 0, os.strerror(ctypes.get_errno())
        libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(byte & 1 for byte in residency.raw)


def _filesystem_bypasses_cache(directory: Path) -> bool:
    """Probe with a plain O_DIRECT write (not checkfreq's code) whether pages stay out of the cache."""
    block = mmap.mmap(-1, BLOCK_BYTES)  # page-aligned
    try:
        fd = os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    try:
        os.write(fd, block)
    finally:
        os.close(fd)
    return _cached_pages(directory / "probe") == 0


def _payload(nbytes: int, aligned: bool) -> torch.Tensor:
    buffer = aligned_empty(nbytes + 1, pin=False)
    data = buffer[:nbytes] if aligned else buffer[1:]
    data.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes)))
    return data


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("nbytes", [0, 100, BLOCK_BYTES, 3 * BLOCK_BYTES + 17, (8 << 20) + 5])
def test_the_file_holds_exactly_the_bytes_given(tmp_path: Path, nbytes: int, aligned: bool) -> None:
    header = b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "
    header += b" " * (-len(header) % BLOCK_BYTES)
    data = _payload(nbytes, aligned)
    size, digest = write_data_file(tmp_path / "f", header, data)
    raw = (tmp_path / "f").read_bytes()
    assert size == len(raw) == len(header) + nbytes
    assert raw == header + data.numpy().tobytes()
    assert digest == xxhash.xxh3_64(raw).hexdigest()


@direct_io
def test_an_aligned_data_section_bypasses_the_page_cache(tmp_path: Path) -> None:
    """Written directly, the section's blocks are not in the page cache; the unaligned tail is."""
    data = _payload(64 * BLOCK_BYTES + 100, aligned=True)
    header = b"h" * BLOCK_BYTES
    if not _filesystem_bypasses_cache(tmp_path):
        pytest.skip("this filesystem keeps directly written pages cached (e.g. tmpfs)")
    hasher = xxhash.xxh3_64()
    write_chunks(tmp_path / "f", data_chunks(header, data, hasher))
    cached = _cached_pages(tmp_path / "f")
    assert cached <= 2, f"{cached} pages of a directly written file are cached"  # the header and the tail
    assert (tmp_path / "f").read_bytes() == header + data.numpy().tobytes()


@direct_io
def test_a_filesystem_that_refuses_direct_io_gets_normal_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where setting O_DIRECT fails (EINVAL), every byte is written through the page cache."""
    real_fcntl = checkfreq.storage.posix.fcntl.fcntl

    def refusing(fd: int, command: int, arg: int = 0) -> int:
        if command == checkfreq.storage.posix.fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, command, arg)

    monkeypatch.setattr(checkfreq.storage.posix.fcntl, "fcntl", refusing)
    data = _payload(16 * BLOCK_BYTES, aligned=True)
    header = b"h" * BLOCK_BYTES
    size, _ = write_data_file(tmp_path / "f", header, data)
    assert (tmp_path / "f").read_bytes() == header + data.numpy().tobytes()
    assert _cached_pages(tmp_path / "f") == size // PAGE


def test_snapshot_buffers_and_headers_are_block_aligned() -> None:
    from checkfreq.storage.format import encode_header, plan_layout

    for nbytes in (0, 1, 12345, 1 << 20):
        assert aligned_empty(nbytes, pin=False).data_ptr() % BLOCK_BYTES == 0
    layout = plan_layout({"w": (torch.float32, (3, 5)), "step": (torch.int64, ())})
    assert len(encode_header(layout)) % BLOCK_BYTES == 0
