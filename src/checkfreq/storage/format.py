"""The on-disk schema: safetensors data files and the ``manifest.json`` that commits them.

A data file is a standard safetensors file (readable by ``safetensors.safe_open``). Its tensors
are laid out largest element size first, so every tensor starts at an offset aligned to its
element size and one flat host buffer can hold the whole data section. This module plans that
layout, encodes and decodes headers, and builds and validates manifests; reading and writing
the files themselves is the stores' business (``storage.posix`` for local files).

Nothing here unpickles: headers and manifests are JSON, validated before any allocation.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict, cast

import numpy as np
import torch
import xxhash

from checkfreq.errors import CorruptCheckpointError, PersistError, UnsupportedDtypeError

SCHEMA_VERSION = 3
"""Version 3 seals the manifest with a checksum of its own bytes (:func:`seal_manifest`); version 2 keeps
what is per rank in each rank's data file (see :class:`Manifest`). Versions 1 and 2 are still read."""
READABLE_SCHEMA_VERSIONS = (1, 2, 3)
SEALED_SCHEMA_VERSION = 3
"""The first version whose manifests must carry :data:`MANIFEST_CHECKSUM_KEY`."""
MANIFEST_CHECKSUM_KEY = "manifest_xxh3_64"
"""The manifest's last member: the xxh3-64 (hex) of every byte of ``manifest.json`` before it."""
_SEAL = re.compile(rb'"' + MANIFEST_CHECKSUM_KEY.encode() + rb'": "([0-9a-f]{16})"\n\}\Z')
RANK_RECORD_KEY = "checkfreq"
"""The key of a data file's safetensors ``__metadata__`` that holds its rank's record (JSON)."""
MANIFEST_NAME = "manifest.json"
CHUNK_BYTES = 64 << 20
"""Bytes of a data file read, written or hashed at a time; fixed, as the stored checksums depend on it
(:func:`checkfreq.storage.parallel_hash.chunked_xxh3` hashes each chunk on its own)."""
BLOCK_BYTES = 4096
"""Alignment of data sections, in files and in snapshot buffers, for direct I/O."""
MAX_HEADER_BYTES = 100 << 20
MAX_MANIFEST_BYTES = 256 << 20
MAX_JSON_DEPTH = 200
"""The deepest nesting of arrays and objects a reader parses (a manifest, a header, a rank's record).
Deeper JSON is refused before it is parsed, so the refusal does not depend on the interpreter's
recursion limit, on how deep the caller's stack already is, or on the thread it runs on."""
_SAFE_FILE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEPS = np.zeros(256, dtype=np.int32)
_BRACKET_STEPS[list(b"[{")], _BRACKET_STEPS[list(b"]}")] = 1, -1


def json_depth(raw: bytes) -> int:
    """How deeply the arrays and objects of the JSON text ``raw`` nest (0: a scalar), without
    parsing it and without recursion; for a text that is not JSON, at least the depth a parser
    reaches before it finds out. Brackets inside strings do not count."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    return max(int(_BRACKET_STEPS[np.frombuffer(brackets, dtype=np.uint8)].cumsum().max()), 0)


def parse_json(raw: bytes | str) -> Any:
    """``json.loads(raw)``, refusing with :class:`ValueError` a text nested deeper than
    :data:`MAX_JSON_DEPTH` before parsing it (the parser's own guard, :class:`RecursionError`,
    depends on the recursion limit and the stack already in use)."""
    data = raw.encode() if isinstance(raw, str) else raw
    if (depth := json_depth(data)) > MAX_JSON_DEPTH:
        raise ValueError(f"JSON nested {depth} levels deep, over the {MAX_JSON_DEPTH} a reader accepts")
    return json.loads(data)


_CHECKPOINT_NAME = re.compile(r"^step_(\d{9,})$")
_TYPED_CHECKPOINT_NAME = re.compile(r"^step_(\d+)$")


def checkpoint_name(step: int) -> str:
    """The name of checkpoint ``step``'s directory (or prefix, on an object store): ``step_000001200``."""
    return f"step_{step:09d}"


def checkpoint_step(name: str) -> int | None:
    """The step of a committed checkpoint named ``name`` (:func:`checkpoint_name`'s form), else None."""
    match = _CHECKPOINT_NAME.match(name)
    return int(match.group(1)) if match else None


def typed_checkpoint_step(name: str) -> int | None:
    """The step a person means by ``name``: ``step_1200`` as well as ``step_000001200``; else None."""
    match = _TYPED_CHECKPOINT_NAME.match(name)
    return int(match.group(1)) if match else None


def data_file_name(rank: int) -> str:
    """The data file rank ``rank`` writes into each checkpoint (``rank00000.safetensors`` for one process)."""
    return f"rank{rank:05d}.safetensors"


def data_file_rank(name: str) -> int:
    """The rank that wrote the data file ``name`` (``rank00003.safetensors``: 3)."""
    return int(name[len("rank") :].split(".")[0])


DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
DTYPES_BY_CODE: dict[str, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}


class FileEntry(TypedDict):
    """The manifest's record of one data file."""

    size: int
    xxh3_64: str
    """The xxh3-64 checksum of the whole file, in hex."""


class TensorEntry(TypedDict):
    """The manifest's record of one stored array: its file, safetensors dtype code, shape, and byte
    range ``[begin, end)`` within the file's data section."""

    file: str
    dtype: str
    shape: list[int]
    offsets: list[int]


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives inside a data section: byte range ``[begin, end)``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Layout:
    """The planned placement of a set of tensors in one data section."""

    slots: tuple[TensorSlot, ...]
    nbytes: int

    @property
    def signature(self) -> tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]:
        """What must match for a host buffer to be reused: names, dtypes and shapes."""
        return tuple((s.name, s.dtype, s.shape) for s in self.slots)


def dtype_code(name: str, dtype: torch.dtype) -> str:
    """The safetensors code for ``dtype``, or a clear error naming the tensor."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise UnsupportedDtypeError(f"tensor {name!r} has dtype {dtype}, which checkfreq cannot store") from None


def plan_layout(specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> Layout:
    """Place tensors (name → (dtype, shape)) contiguously, largest element size first.

    Each tensor's size is a multiple of its element size, so sorting by element size keeps
    every offset aligned without padding (safetensors forbids holes in the data section).
    """
    for name, (dtype, _) in specs.items():
        dtype_code(name, dtype)
    order = sorted(specs, key=lambda n: (-specs[n][0].itemsize, n))
    slots, offset = [], 0
    for name in order:
        dtype, shape = specs[name]
        numel = 1
        for dim in shape:
            numel *= dim
        end = offset + numel * dtype.itemsize
        slots.append(TensorSlot(name, dtype, tuple(shape), offset, end))
        offset = end
    return Layout(tuple(slots), offset)


def slot_view(buffer: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    """A typed, shaped view of ``slot`` inside a flat ``uint8`` buffer (no copy)."""
    return buffer[slot.begin : slot.end].view(slot.dtype).view(slot.shape)


def encode_header(layout: Layout, record: Any = None) -> bytes:
    """The safetensors prefix (length + JSON header) for ``layout``.

    ``record`` (JSON-able), if given, is stored as the header's ``__metadata__`` under
    :data:`RANK_RECORD_KEY`: a rank's own part of a checkpoint written by several ranks.
    The header is space-padded (as safetensors allows) so that the data section starts at a
    multiple of :data:`BLOCK_BYTES`: the section can then be written with direct I/O.
    """
    header: dict[str, Any] = {}
    if record is not None:
        header["__metadata__"] = {RANK_RECORD_KEY: json.dumps(record, separators=(",", ":"))}
    header.update(
        {
            s.name: {"dtype": DTYPE_CODES[s.dtype], "shape": list(s.shape), "data_offsets": [s.begin, s.end]}
            for s in layout.slots
        }
    )
    raw = json.dumps(header, separators=(",", ":")).encode()
    if len(raw) > MAX_HEADER_BYTES:
        raise PersistError(
            f"a data file header would be {len(raw)} bytes, over the {MAX_HEADER_BYTES} bytes a reader accepts"
        )
    raw += b" " * (-(len(raw) + 8) % BLOCK_BYTES)
    return struct.pack("<Q", len(raw)) + raw


def data_chunks(header: bytes, data: torch.Tensor, hasher: Any) -> Iterator[memoryview]:
    """The bytes of a data file in order: ``header``, then views of ``data`` (no copy).

    Each chunk is fed to ``hasher`` as it is handed out, so once the chunks are consumed the
    hasher holds the digest of the whole file. Any store's ``write_file`` can take them.
    """
    hasher.update(header)
    yield memoryview(header)
    view = data.numpy().data if data.numel() else memoryview(b"")
    for start in range(0, len(view), CHUNK_BYTES):
        chunk = view[start : start + CHUNK_BYTES]
        hasher.update(chunk)
        yield chunk


def decode_header_length(prefix: bytes, size: int, name: str) -> int:
    """The header length a data file of ``size`` bytes declares in its 8-byte ``prefix``, checked."""
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > min(MAX_HEADER_BYTES, size - 8):
        raise CorruptCheckpointError(f"data file {name} declares an impossible header of {header_len} bytes")
    return header_len


def decode_header(raw: bytes, name: str) -> dict[str, Any]:
    """Parse a data file's JSON header (``name`` is the file's name for error messages)."""
    try:
        header = parse_json(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"data file {name} has an unreadable header: {e}") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"data file {name} header is not a JSON object")
    return header


@dataclass(frozen=True)
class Manifest:
    """The commit record of one checkpoint (``manifest.json``), written last.

    Written by several ranks (schema version 2), it holds only what is not per rank: every data
    file's size and checksum, and the replicated and sharded tensors' global dtype, shape and (for
    replicated ones) pieces; ``tensors`` is empty and ``state`` is None. Each rank's skeleton and
    its own tensors (private ones, its shards) are in its data file's header (:func:`rank_record`),
    and :func:`checkfreq.ranks.rebuild.complete` adds them once the files are read. A version 1
    manifest holds them itself (``distributed["ranks"]``).
    """

    step: int
    epoch: int | None
    world_size: int
    files: dict[str, FileEntry]
    """data file name → its size and checksum."""
    tensors: dict[str, TensorEntry]
    """stored array name → where it lies."""
    state: Any
    """JSON skeleton of the registered objects; tensors appear as references to ``tensors``."""
    versions: dict[str, str]
    created: float
    distributed: dict[str, Any] | None = None
    """Written by several ranks: per-rank skeletons and how each tensor is split (see :mod:`checkfreq.ranks.shares`)."""
    score: dict[str, Any] | None = None
    """With a retention that keeps the best: rank 0's score at the capture
    (:mod:`checkfreq.pipeline.retention.best`)."""

    @property
    def complete(self) -> bool:
        """Whether every rank's part is here (else it is in the data files' headers)."""
        return self.distributed is None or "ranks" in self.distributed

    def to_json(self) -> bytes:
        """The manifest's bytes; :class:`PersistError` if a reader would refuse them as too large."""
        raw = seal_manifest({"format": "checkfreq", "schema_version": SCHEMA_VERSION, **self.__dict__})
        if len(raw) > MAX_MANIFEST_BYTES:
            raise PersistError(
                f"manifest.json would be {len(raw)} bytes, over the {MAX_MANIFEST_BYTES} bytes a reader accepts"
            )
        return raw

    @classmethod
    def from_json(cls, raw: bytes, *, step: int | None = None) -> Manifest:
        """Parse and validate a manifest, its checksum first; any defect raises :class:`CorruptCheckpointError`.

        ``step``: the step its place names (a ``step_N`` directory, a memory slot); a manifest that
        records another step is damage too."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError("manifest is implausibly large")
        sealed = _check_seal(raw)
        try:
            doc = parse_json(raw)
        except (ValueError, RecursionError) as e:
            raise CorruptCheckpointError(f"manifest is not valid JSON: {e}") from None
        if not isinstance(doc, dict) or doc.get("format") != "checkfreq":
            raise CorruptCheckpointError("manifest is not a checkfreq manifest")
        if doc.get("schema_version") not in READABLE_SCHEMA_VERSIONS:
            raise CorruptCheckpointError(f"manifest schema version {doc.get('schema_version')!r} is not supported")
        if MANIFEST_CHECKSUM_KEY in doc and not sealed:
            raise CorruptCheckpointError(
                f"{MANIFEST_NAME}'s checksum ({MANIFEST_CHECKSUM_KEY}) is malformed or not its last member: "
                "the file was edited after it was written"
            )
        if not sealed and doc["schema_version"] >= SEALED_SCHEMA_VERSION:
            raise CorruptCheckpointError(f"{MANIFEST_NAME} lacks its checksum ({MANIFEST_CHECKSUM_KEY})")
        try:
            manifest = cls(
                step=_expect(doc["step"], int, "step"),
                epoch=None if doc["epoch"] is None else _expect(doc["epoch"], int, "epoch"),
                world_size=_expect(doc["world_size"], int, "world_size"),
                files=_expect(doc["files"], dict, "files"),
                tensors=_expect(doc["tensors"], dict, "tensors"),
                state=doc["state"],
                versions=_expect(doc["versions"], dict, "versions"),
                created=float(_expect(doc["created"], (int, float), "created")),
                distributed=None
                if doc.get("distributed") is None
                else _expect(doc["distributed"], dict, "distributed"),
                score=None if doc.get("score") is None else _expect(doc["score"], dict, "score"),
            )
        except KeyError as e:
            raise CorruptCheckpointError(f"manifest lacks field {e}") from None
        except OverflowError:
            raise CorruptCheckpointError("manifest field created is out of range") from None
        if step is not None and manifest.step != step:
            raise CorruptCheckpointError(
                f"{MANIFEST_NAME} records step {manifest.step}, but it lies in {checkpoint_name(step)}"
            )
        return manifest.checked()

    def checked(self) -> Manifest:
        """This manifest, validated as :meth:`from_json` validates one read from storage."""
        try:
            self._validate()
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
            raise CorruptCheckpointError(f"manifest is malformed: {type(e).__name__}: {e}") from None
        return self

    def _validate(self) -> None:
        if self.step < 0 or self.world_size < 1:
            raise CorruptCheckpointError("manifest has a negative step or a world size below 1")
        for name, entry in self.files.items():
            if not _SAFE_FILE_NAME.match(name) or name in (".", "..") or name == MANIFEST_NAME:
                raise CorruptCheckpointError(f"manifest names an unsafe data file {name!r}")
            if not isinstance(entry, dict):
                raise CorruptCheckpointError(f"manifest entry for {name!r} is not an object")
            _expect(entry.get("size"), int, f"files[{name!r}].size")
            _expect(entry.get("xxh3_64"), str, f"files[{name!r}].xxh3_64")
        for name, tensor in self.tensors.items():
            if not isinstance(tensor, dict) or tensor.get("file") not in self.files:
                raise CorruptCheckpointError(f"tensor {name!r} refers to no listed data file")
            if tensor.get("dtype") not in DTYPES_BY_CODE:
                raise CorruptCheckpointError(f"tensor {name!r} has unknown dtype {tensor.get('dtype')!r}")
            shape, offsets = tensor.get("shape"), tensor.get("offsets")
            if not (isinstance(shape, list) and all(isinstance(d, int) and 0 <= d < 2**63 for d in shape)):
                raise CorruptCheckpointError(f"tensor {name!r} has a malformed shape")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
                raise CorruptCheckpointError(f"tensor {name!r} has malformed offsets")
            numel = 1
            for d in shape:
                numel *= d
            begin, end = offsets
            itemsize = DTYPES_BY_CODE[tensor["dtype"]].itemsize
            if begin < 0 or end - begin != numel * itemsize or begin % itemsize:
                raise CorruptCheckpointError(f"tensor {name!r} offsets do not match its shape and dtype")
            if end > self.files[tensor["file"]]["size"]:
                raise CorruptCheckpointError(f"tensor {name!r} lies beyond the end of its file")


def seal_manifest(doc: Mapping[str, Any]) -> bytes:
    """The bytes of ``manifest.json`` holding ``doc``, sealed: its last member, :data:`MANIFEST_CHECKSUM_KEY`,
    is the xxh3-64 of every byte before it, so that no byte of the file changes unnoticed."""
    # on one line: json's C encoder writes it, where indenting takes its Python one, five times slower
    # (a manifest entry per tensor, built on the training thread for a memory snapshot)
    body = json.dumps({k: v for k, v in doc.items() if k != MANIFEST_CHECKSUM_KEY}, allow_nan=True)
    head = (body[:-1] + ",\n " if body != "{}" else "{\n ").encode()
    return head + f'"{MANIFEST_CHECKSUM_KEY}": "{xxhash.xxh3_64_hexdigest(head)}"\n}}'.encode()


def _check_seal(raw: bytes) -> bool:
    """Whether ``raw`` ends with a checksum member (:func:`seal_manifest`); :class:`CorruptCheckpointError`
    if the bytes before it do not match it."""
    seal = _SEAL.search(raw, max(0, len(raw) - 64))
    if seal is None:
        return False
    if xxhash.xxh3_64_hexdigest(raw[: seal.start()]) != seal.group(1).decode():
        raise CorruptCheckpointError(
            f"{MANIFEST_NAME} fails its checksum: it was edited or damaged after it was written"
        )
    return True


def _expect(value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CorruptCheckpointError(f"manifest field {what} has the wrong type")
    return value


def tensor_entries(layout: Layout, file_name: str) -> dict[str, TensorEntry]:
    """The manifest's tensor index for one data file laid out by ``layout``."""
    return {
        s.name: TensorEntry(file=file_name, dtype=DTYPE_CODES[s.dtype], shape=list(s.shape), offsets=[s.begin, s.end])
        for s in layout.slots
    }


def header_entries(header: Mapping[str, Any], file_name: str) -> dict[str, TensorEntry]:
    """A data file's tensors, as manifest tensor entries (unchecked: :meth:`Manifest.checked` checks them)."""
    entries: dict[str, TensorEntry] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise CorruptCheckpointError(f"data file {file_name} describes tensor {name!r} with no object")
        unchecked = {
            "file": file_name,
            "dtype": entry.get("dtype"),
            "shape": entry.get("shape"),
            "offsets": entry.get("data_offsets"),
        }
        entries[name] = cast(TensorEntry, unchecked)
    return entries


def rank_record(header: Mapping[str, Any], file_name: str) -> dict[str, Any]:
    """The record a rank stored in its data file's header (:func:`encode_header`)."""
    meta = header.get("__metadata__")
    raw = meta.get(RANK_RECORD_KEY) if isinstance(meta, dict) else None
    if not isinstance(raw, str):
        raise CorruptCheckpointError(f"data file {file_name} lacks its rank's record (__metadata__.{RANK_RECORD_KEY})")
    try:
        record = parse_json(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"data file {file_name} has an unreadable rank record: {e}") from None
    if not isinstance(record, dict) or not isinstance(record.get("tensors"), dict):
        raise CorruptCheckpointError(f"data file {file_name} has a malformed rank record")
    return record


def entry_view(data: torch.Tensor, entry: Mapping[str, Any]) -> torch.Tensor:
    """A view of one manifest tensor entry inside a verified data section."""
    begin, end = entry["offsets"]
    if end > data.numel():
        raise CorruptCheckpointError("a tensor lies beyond the end of its data section")
    try:
        return data[begin:end].view(DTYPES_BY_CODE[entry["dtype"]]).view(tuple(entry["shape"]))
    except (RuntimeError, OverflowError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"a tensor entry does not fit its data section: {e}") from None
