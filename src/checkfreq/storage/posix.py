"""Checkpoint files on a POSIX filesystem: direct-I/O writes with fsync, mapped or streamed reads.

Writes go straight from the snapshot buffer (no copy): whole aligned blocks with ``O_DIRECT``,
everything else with ``pwrite``, then ``fsync``. Reads verify a data file's size and xxh3-64
checksum over a private, copy-on-write memory mapping, or over a stream where a file cannot be
mapped; :func:`read_data_stream` takes any binary file object, so other stores (fsspec) read
through it too. The bytes themselves are laid out and decoded by :mod:`checkfreq.storage.format`.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from checkfreq.errors import CorruptCheckpointError
from checkfreq.storage.format import (
    BLOCK_BYTES,
    CHUNK_BYTES,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    checkpoint_step,
    data_chunks,
    decode_header,
    decode_header_length,
)
from checkfreq.storage.progress import chunk_read

_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux; elsewhere every write goes through the page cache


def write_data_file(path: Path, header: bytes, data: torch.Tensor) -> tuple[int, str]:
    """Write ``header`` then the flat ``uint8`` CPU buffer ``data`` to ``path`` and fsync it.

    Writes straight from the buffer in large chunks (no copy), hashing each chunk as it goes.
    Returns (file size, xxh3-64 hex digest of the whole file).
    """
    hasher = xxhash.xxh3_64()
    size = write_chunks(path, data_chunks(header, data, hasher))
    return size, hasher.hexdigest()


def write_chunks(path: Path, chunks: Iterable[bytes | memoryview]) -> int:
    """Create ``path`` (it must not exist), write ``chunks`` and fsync; return the size.

    Whole blocks of a chunk that lies at a :data:`BLOCK_BYTES`-aligned address and file offset
    (a data section in a snapshot buffer) are written with ``O_DIRECT``: the device reads them
    from the buffer, and the kernel neither copies them into the page cache nor flushes them
    later. Everything else, and every filesystem that refuses direct I/O, is written normally.
    """
    offset = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for chunk in chunks:
            chunk = memoryview(chunk).cast("B")
            direct = _direct_length(chunk, offset)
            if direct and _write_direct(fd, chunk[:direct], offset):
                _write_all(fd, chunk[direct:], offset + direct)
            else:
                _write_all(fd, chunk, offset)
            offset += len(chunk)
        os.fsync(fd)
    finally:
        os.close(fd)
    return offset


def _direct_length(chunk: memoryview, offset: int) -> int:
    """How many leading bytes of ``chunk`` may be written with ``O_DIRECT`` at file ``offset``."""
    if not _O_DIRECT or offset % BLOCK_BYTES or len(chunk) < BLOCK_BYTES:
        return 0
    if np.frombuffer(chunk, dtype=np.uint8).ctypes.data % BLOCK_BYTES:
        return 0
    return len(chunk) - len(chunk) % BLOCK_BYTES


def _write_direct(fd: int, chunk: memoryview, offset: int) -> bool:
    """Write ``chunk`` at ``offset`` bypassing the page cache; False if the filesystem refuses."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT)
    except OSError:
        return False
    try:
        _write_all(fd, chunk, offset)
    except OSError as e:
        if e.errno != errno.EINVAL:  # EINVAL: an alignment this device does not accept
            raise
        return False
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return True


def _write_all(fd: int, chunk: memoryview, offset: int) -> None:
    while chunk:
        written = os.pwrite(fd, chunk, offset)
        chunk, offset = chunk[written:], offset + written


def read_data_file(
    path: Path, size: int, checksum: str, *, verified: bool = False
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Verify a data file; return its data section (flat ``uint8``) and parsed header.

    The section is a private, copy-on-write memory mapping of the file: the checksum is computed
    straight from the page cache and nothing is copied until the caller copies tensors out
    (writes to the section never reach the file). Where a file cannot be mapped, it is read
    into memory instead. ``verified``: another process on this machine has just verified this very
    file, so a mapping (the same pages of the page cache) is not hashed again. Raises
    :class:`CorruptCheckpointError` if the size, checksum or header is wrong.
    """
    f = _open_regular(path, f"data file {path.name}")
    actual = os.fstat(f.fileno()).st_size
    if actual != size or size < 8:
        return read_data_stream(f, path.name, actual, size, checksum)  # raises the size error
    try:
        mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    except OSError:  # a filesystem that cannot map files
        return read_data_stream(f, path.name, actual, size, checksum)
    f.close()  # the mapping keeps the file
    if not verified:
        _verify_mapping(mapping, path.name, checksum)
    return _parse_mapping(mapping, path.name)


def _verify_mapping(mapping: mmap.mmap, name: str, checksum: str) -> None:
    """Hash a mapped data file against its checksum."""
    if hasattr(mapping, "madvise"):
        mapping.madvise(mmap.MADV_SEQUENTIAL)  # aggressive readahead when cold (measured best)
    hasher = xxhash.xxh3_64()
    with memoryview(mapping) as view:
        try:
            for start in range(0, len(view), CHUNK_BYTES):  # chunks: the GIL is free between them
                hasher.update(view[start : start + CHUNK_BYTES])
                chunk_read(min(CHUNK_BYTES, len(view) - start))
        except OSError as e:
            raise CorruptCheckpointError(f"data file {name} cannot be read: {e.strerror or e}") from None
    if hasher.hexdigest() != checksum:
        raise CorruptCheckpointError(f"data file {name} fails its checksum (content changed or torn)")


def _parse_mapping(mapping: mmap.mmap, name: str) -> tuple[torch.Tensor, dict[str, Any]]:
    """Parse a mapped data file; the data section is a view of the mapping."""
    header_len = decode_header_length(mapping[:8], len(mapping), name)
    header = decode_header(mapping[8 : 8 + header_len], name)
    begin = 8 + header_len
    if begin == len(mapping):
        return torch.empty(0, dtype=torch.uint8), header
    return torch.frombuffer(mapping, dtype=torch.uint8, offset=begin, count=len(mapping) - begin), header


def read_data_stream(f: Any, name: str, actual: int, size: int, checksum: str) -> tuple[torch.Tensor, dict[str, Any]]:
    """:func:`read_data_file` for an open binary file object ``f`` of ``actual`` bytes (closed here).

    ``name`` is the file's name for error messages. Stores that are not local directories
    (fsspec) read through this.
    """
    with f:
        if actual != size:
            raise CorruptCheckpointError(f"data file {name} has {actual} bytes, manifest says {size}")
        try:
            data, header_bytes, digest = _read_sections(f, size, name)
        except OSError as e:
            raise CorruptCheckpointError(f"data file {name} cannot be read: {e.strerror or e}") from None
    if digest != checksum:
        raise CorruptCheckpointError(f"data file {name} fails its checksum (content changed or torn)")
    return data, decode_header(header_bytes, name)


def _read_sections(f: Any, size: int, name: str) -> tuple[torch.Tensor, bytes, str]:
    """Read a data file's header and data section, hashing as it goes."""
    hasher = xxhash.xxh3_64()
    prefix = _read_exact(f, 8, name)
    header_len = decode_header_length(prefix, size, name)
    header_bytes = _read_exact(f, header_len, name)
    hasher.update(prefix)
    hasher.update(header_bytes)
    chunk_read(8 + header_len)
    data = torch.empty(size - 8 - header_len, dtype=torch.uint8)
    view = data.numpy().data if data.numel() else memoryview(bytearray())
    for start in range(0, len(view), CHUNK_BYTES):
        chunk = view[start : start + CHUNK_BYTES]
        if f.readinto(chunk) != len(chunk):
            raise CorruptCheckpointError(f"data file {name} is shorter than its size")
        hasher.update(chunk)
        chunk_read(len(chunk))
    return data, header_bytes, hasher.hexdigest()


def _open_regular(path: Path, what: str) -> Any:
    """Open ``path`` for reading, refusing anything but a regular file (a FIFO would block forever) and
    a symbolic link (a checkpoint's files are its directory's own).

    Any OS error (missing, unreadable, I/O error) becomes :class:`CorruptCheckpointError`.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{what} is missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):
            raise CorruptCheckpointError(f"{what} is a symbolic link, not a file of the checkpoint's own") from None
        raise CorruptCheckpointError(f"{what} cannot be opened: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{what} is not a regular file")
    return open(fd, "rb", buffering=0)


def _read_exact(f: Any, n: int, name: str) -> bytes:
    raw = f.read(n)
    if len(raw) != n:
        raise CorruptCheckpointError(f"data file {name} is truncated")
    return raw


def read_manifest(directory: Path) -> Manifest:
    """Read and validate ``directory/manifest.json`` (of the step ``directory``'s name says, if it names one)."""
    return Manifest.from_json(read_manifest_bytes(directory), step=checkpoint_step(directory.name))


def read_manifest_bytes(directory: Path) -> bytes:
    """The bytes of ``directory/manifest.json``, unchecked; :class:`CorruptCheckpointError` if it is
    missing, too large, unreadable or not a regular file of the directory's own."""
    path = directory / MANIFEST_NAME
    if not os.path.lexists(path):
        raise CorruptCheckpointError("manifest.json is missing (checkpoint never committed)")
    with _open_regular(path, MANIFEST_NAME) as f:
        if os.fstat(f.fileno()).st_size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError("manifest is implausibly large")
        try:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        except OSError as e:
            raise CorruptCheckpointError(f"{MANIFEST_NAME} cannot be read: {e.strerror}") from None
    return raw
