"""Hostile and malformed checkpoints: only checkfreq's documented errors, never code execution.

Property tests (hypothesis) feed random bytes and structured mutations of a real manifest and
data file to the readers; anything other than a :class:`CheckfreqError` (or a crash, a hang, a
huge allocation) fails the test.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import pathlib
import pickle
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import checkfreq as cf
from checkfreq.pipeline.restore import read_checkpoint
from checkfreq.run.state import MAX_STATE_DEPTH, unflatten
from checkfreq.storage.format import MANIFEST_NAME, MAX_JSON_DEPTH, Manifest, json_depth, seal_manifest
from checkfreq.storage.posix import read_data_file, read_manifest
from helpers import make_model, train_step

FUZZ = settings(
    max_examples=int(os.environ.get("CHECKFREQ_FUZZ_EXAMPLES", "150")),  # 2000 for a deeper run
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
HOSTILE_NAMES = ["../evil", "/etc/passwd", "a/b", "..", ".", "", "manifest.json", "x" * 200, "nul\x00", "ü.bin"]


def _real_checkpoint(root: Path) -> Path:
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    with cf.Checkpointer(root, policy=1, model=model, optimizer=opt) as ckpt:
        train_step(model, opt)
        ckpt.step()
    (path,) = root.glob("step_*")
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _real_checkpoint(tmp_path_factory.mktemp("fuzz"))


def _only_checkfreq_errors(call: Any, *args: Any) -> None:
    try:
        call(*args)
    except cf.CheckfreqError:
        pass


def _mutate(doc: Any, path: list[Any], value: Any) -> Any:
    """A copy of ``doc`` with the node at ``path`` (keys/indices, possibly shortened) replaced by ``value``."""
    doc = copy.deepcopy(doc)
    node, parent, key = doc, None, None
    for step in path:
        if isinstance(node, dict) and node:
            parent, key = node, sorted(node)[step % len(node)]
        elif isinstance(node, list) and node:
            parent, key = node, step % len(node)
        else:
            break
        node = parent[key]
    if parent is None:
        return value
    parent[key] = value
    return doc


def _resealed(doc: Any) -> bytes:
    """A mutated manifest with a checksum that matches it (else the checksum refuses it before the checks
    the fuzzing is for), or, where it is no longer an object, its JSON."""
    return seal_manifest(doc) if isinstance(doc, dict) else json.dumps(doc).encode()


@FUZZ
@given(raw=st.binary(max_size=2048))
def test_manifest_from_random_bytes(raw: bytes) -> None:
    _only_checkfreq_errors(Manifest.from_json, raw)


@FUZZ
@given(raw=st.binary(max_size=1024) | JSON.map(lambda v: json.dumps(v).encode()))
def test_read_manifest_from_a_random_file(tmp_path: Path, raw: bytes) -> None:
    (tmp_path / MANIFEST_NAME).write_bytes(raw)
    _only_checkfreq_errors(read_manifest, tmp_path)


@FUZZ
@given(path=st.lists(st.integers(0, 50), min_size=1, max_size=6), value=JSON)
def test_manifest_with_a_mutated_field(checkpoint: Path, path: list[int], value: Any) -> None:
    doc = json.loads((checkpoint / MANIFEST_NAME).read_bytes())
    _only_checkfreq_errors(Manifest.from_json, _resealed(_mutate(doc, path, value)))


@FUZZ
@given(path=st.lists(st.integers(0, 50), min_size=1, max_size=6), value=JSON)
def test_checkpoint_with_a_mutated_manifest_is_refused_or_read(checkpoint: Path, path: list[int], value: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / checkpoint.name
        target.mkdir()
        for f in checkpoint.iterdir():
            if f.name != MANIFEST_NAME:
                os.link(f, target / f.name)
        doc = json.loads((checkpoint / MANIFEST_NAME).read_bytes())
        (target / MANIFEST_NAME).write_bytes(_resealed(_mutate(doc, path, value)))
        try:
            manifest, tensors = read_checkpoint(target)
            unflatten(manifest.state, tensors)
        except cf.CheckfreqError:
            pass


@FUZZ
@given(skeleton=JSON | st.builds(lambda v: {"__items__": v}, JSON) | st.builds(lambda v: {"__tuple__": v}, JSON))
def test_state_skeleton_never_escapes(skeleton: Any) -> None:
    _only_checkfreq_errors(unflatten, skeleton, {"t": torch.zeros(2, dtype=torch.bfloat16)})


@FUZZ
@given(raw=st.binary(max_size=512), valid_checksum=st.booleans())
def test_data_file_from_random_bytes(tmp_path: Path, raw: bytes, valid_checksum: bool) -> None:
    path = tmp_path / "rank00000.safetensors"
    path.write_bytes(raw)
    checksum = xxhash.xxh3_64(raw).hexdigest() if valid_checksum else "0"
    _only_checkfreq_errors(read_data_file, path, len(raw), checksum)


@FUZZ
@given(
    header=st.binary(max_size=256) | JSON.map(lambda v: json.dumps(v).encode()),
    declared=st.integers(0, 2**64 - 1),
    tail=st.binary(max_size=64),
)
def test_data_file_with_a_hostile_header(tmp_path: Path, header: bytes, declared: int, tail: bytes) -> None:
    """The header length is a u64 read from the file: a huge one must never allocate."""
    for length in (len(header), declared):
        raw = struct.pack("<Q", length) + header + tail
        path = tmp_path / "f.safetensors"
        path.write_bytes(raw)
        _only_checkfreq_errors(read_data_file, path, len(raw), xxhash.xxh3_64(raw).hexdigest())


@pytest.mark.parametrize("recursion_limit", [None, 2000, 1_000_000])
def test_deep_nesting_is_refused(tmp_path: Path, recursion_limit: int | None) -> None:
    """Refused by depth, whatever the recursion limit: code in the process may raise it (torch's
    inductor raises it to 2000 when it compiles, hypothesis raises it during a @given test), and a
    refusal that waited for RecursionError then rebuilt a 900-level skeleton."""
    before = sys.getrecursionlimit()
    if recursion_limit is not None:
        sys.setrecursionlimit(recursion_limit)
    try:
        deep = b"[" * 200_000 + b"]" * 200_000
        with pytest.raises(cf.CorruptCheckpointError, match="not valid JSON.*nested 200000 levels"):
            Manifest.from_json(deep)
        raw = struct.pack("<Q", len(deep)) + deep
        (tmp_path / "d").write_bytes(raw)
        with pytest.raises(cf.CorruptCheckpointError, match="unreadable header"):
            read_data_file(tmp_path / "d", len(raw), xxhash.xxh3_64(raw).hexdigest())
        for levels in (MAX_STATE_DEPTH + 2, 900):  # a value under MAX_STATE_DEPTH + 1 lists
            with pytest.raises(cf.CorruptCheckpointError, match="malformed"):
                unflatten(json.loads(b"[" * levels + b"]" * levels), {})
        assert unflatten(json.loads(b"[" * (MAX_STATE_DEPTH + 1) + b"]" * (MAX_STATE_DEPTH + 1)), {})
    finally:
        sys.setrecursionlimit(before)


def test_json_depth_skips_strings() -> None:
    assert json_depth(rb'{"a": ["[[{", "\\", "\"[["], "b": {}}') == 2
    assert json_depth(b"3") == 0 and json_depth(b"[]") == 1
    assert json_depth(b"[" * (MAX_JSON_DEPTH + 1)) == MAX_JSON_DEPTH + 1


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_path_traversal_in_file_names_is_refused(checkpoint: Path, name: str) -> None:
    doc = json.loads((checkpoint / MANIFEST_NAME).read_bytes())
    (entry,) = doc["files"].values()
    doc["files"] = {name: entry}
    for tensor in doc["tensors"].values():
        tensor["file"] = name
    with pytest.raises(cf.CorruptCheckpointError, match="unsafe data file"):
        Manifest.from_json(seal_manifest(doc))


@pytest.mark.parametrize("kind", ["fifo", "directory", "dev-zero", "dangling"])
def test_special_files_never_block_or_escape(tmp_path: Path, checkpoint: Path, kind: str) -> None:
    """A FIFO where a data file or manifest should be would block a plain open() forever."""
    for victim in (MANIFEST_NAME, "rank00000.safetensors"):
        target = tmp_path / f"{kind}-{victim}"
        target.mkdir()
        for f in checkpoint.iterdir():
            if f.name != victim:
                (target / f.name).write_bytes(f.read_bytes())
        path = target / victim
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "directory":
            path.mkdir()
        elif kind == "dev-zero":
            path.symlink_to("/dev/zero")
        else:
            path.symlink_to(tmp_path / "nowhere")
        if victim != MANIFEST_NAME:  # make the manifest agree with what stat() reports
            doc = json.loads((target / MANIFEST_NAME).read_bytes())
            doc["files"][victim]["size"] = os.stat(path).st_size if kind != "dangling" else 0
            (target / MANIFEST_NAME).write_bytes(seal_manifest(doc))
        with pytest.raises(cf.CorruptCheckpointError):
            read_checkpoint(target)


class _Bomb:
    """Unpickling this creates a marker file: proof that a loader executed code."""

    marker: pathlib.Path

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (self.marker,))


def test_pickles_in_the_directory_are_never_loaded(tmp_path: Path) -> None:
    root = tmp_path / "run"
    newest = _real_checkpoint(root)
    bomb = _Bomb()
    bomb.marker = tmp_path / "executed"
    payload = pickle.dumps(bomb)
    (newest / "model.pt").write_bytes(payload)
    (root / "checkpoint.pt").write_bytes(payload)
    fake = root / "step_000000099"
    fake.mkdir()
    (fake / "model.pt").write_bytes(payload)
    torch.save({"bomb": bomb}, fake / "state.pt")
    # a checkpoint whose manifest lists the pickle as its data file, with a matching checksum
    listed = root / "step_000000098"
    listed.mkdir()
    (listed / "rank00000.safetensors").write_bytes(payload)
    doc = json.loads((newest / MANIFEST_NAME).read_bytes())
    doc["step"], doc["tensors"] = 98, {}
    doc["files"] = {"rank00000.safetensors": {"size": len(payload), "xxh3_64": xxhash.xxh3_64(payload).hexdigest()}}
    (listed / MANIFEST_NAME).write_bytes(seal_manifest(doc))
    # and a checkpoint whose skeleton holds a pickled value
    pickled = root / "step_000000097"
    pickled.mkdir()
    for f in newest.iterdir():
        (pickled / f.name).write_bytes(f.read_bytes())
    doc = json.loads((newest / MANIFEST_NAME).read_bytes())
    doc["step"] = 97
    doc["state"]["model"] = {"__pickle__": base64.b64encode(payload).decode()}
    (pickled / MANIFEST_NAME).write_bytes(seal_manifest(doc))

    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    with cf.Checkpointer(root, model=model, optimizer=opt) as ckpt:
        with pytest.raises(cf.CheckfreqError):
            ckpt.restore()  # 99 has no manifest, 98 does not fit the model, 97 needs allow_pickle
        assert ckpt.restore(step=1) == 1
    assert not bomb.marker.exists()
