"""Storage chosen by URL: memory:// round trip, manifest-last commit, corruption, two tiers."""

from __future__ import annotations

import ast
import json
import uuid
from pathlib import Path, PurePosixPath

import pytest
import torch

import checkfreq as cf
from checkfreq.policies.retention import Retention
from checkfreq.storage import FsspecStore, open_store
from checkfreq.storage.format import MANIFEST_NAME
from checkfreq.storage.local import LocalStore
from helpers import assert_state_equal, make_model, train_step


@pytest.fixture
def memory_url() -> str:
    return f"memory://checkfreq-test-{uuid.uuid4().hex[:12]}/run"


def _train(ckpt: cf.Checkpointer, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        train_step(model, opt)
        ckpt.step()


def test_urls_choose_the_store(tmp_path: Path, memory_url: str) -> None:
    assert isinstance(open_store(tmp_path / "a"), LocalStore)
    local = open_store(f"file://{tmp_path}/b")
    assert isinstance(local, LocalStore) and local.root == tmp_path / "b"
    assert isinstance(open_store(memory_url), FsspecStore)
    with pytest.raises(ValueError, match="first tier must be a local directory"):
        cf.Checkpointer(memory_url, remote=tmp_path / "d", model=make_model())


def test_storage_modules_import_each_other_only_at_the_top() -> None:
    """No import cycle hidden in a function: ``base`` holds the protocol, the package chooses the store."""
    package = Path(cf.__file__).parent / "storage"
    for module in package.glob("*.py"):
        tree = ast.parse(module.read_text())
        functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for function in functions:
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("checkfreq"):
                    pytest.fail(f"{module.name}: {function.name}() imports {node.module} lazily")
    base = ast.parse((package / "base.py").read_text())
    imported = {node.module for node in ast.walk(base) if isinstance(node, ast.ImportFrom)}
    stores = {name for name in imported if (name or "").startswith("checkfreq.storage")}
    assert stores <= {"checkfreq.storage.format"}, imported  # the protocol needs the schema, no store
    schema = ast.parse((package / "format.py").read_text())  # the on-disk schema does no I/O itself
    modules = {alias.name for node in ast.walk(schema) if isinstance(node, ast.Import) for alias in node.names}
    assert not modules & {"os", "mmap", "fcntl", "stat"}, modules


def test_memory_round_trip_is_bit_identical(memory_url: str) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with cf.Checkpointer(memory_url, policy=2, keep=2, model=model, optimizer=opt, values={"note": "hi"}) as ckpt:
        _train(ckpt, model, opt, 7)
        ckpt.save(blocking=True)
        expected = (model.state_dict(), opt.state_dict())
    store = FsspecStore(memory_url, create=False)
    assert [step for step, _ in store.checkpoints()] == [7, 6]

    model2 = make_model(seed=1)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    with cf.Checkpointer(memory_url, model=model2, optimizer=opt2, values={"note": ""}) as ckpt2:
        assert ckpt2.restore() == 7
        assert ckpt2["note"] == "hi"
    assert_state_equal(model2.state_dict(), expected[0])
    assert_state_equal(opt2.state_dict(), expected[1])


def test_directory_without_manifest_is_never_listed_and_is_cleaned(memory_url: str) -> None:
    model = make_model()
    with cf.Checkpointer(memory_url, model=model) as ckpt:
        ckpt.save(blocking=True)
    store = FsspecStore(memory_url)
    staging = store.staging_dir(5, "killed-job")
    store.write_file(staging, "rank00000.safetensors", [b"half of a checkpoint"])
    assert [step for step, _ in store.checkpoints()] == [0]
    with cf.Checkpointer(memory_url, model=make_model()) as ckpt:
        assert ckpt.restore() == 0
    assert not store.fs.exists(str(staging))


def test_corrupt_remote_checkpoint_falls_back(memory_url: str, caplog: pytest.LogCaptureFixture) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with cf.Checkpointer(memory_url, policy=1, model=model, optimizer=opt) as ckpt:
        _train(ckpt, model, opt, 2)
    store = FsspecStore(memory_url)
    newest = store.checkpoints()[0][1]
    data = str(newest / "rank00000.safetensors")
    raw = bytearray(store.fs.cat_file(data))
    raw[-1] ^= 0xFF
    store.fs.pipe_file(data, bytes(raw))
    with cf.Checkpointer(memory_url, model=make_model(seed=3)) as ckpt:
        assert ckpt.restore() == 1
    assert "fails its checksum" in caplog.text


def test_retention_deletes_manifest_first(memory_url: str) -> None:
    store = FsspecStore(memory_url)
    for step in (1, 2, 3):
        staging = store.staging_dir(step, "job")
        store.write_file(staging, "data", [b"x"])
        store.write_file(staging, MANIFEST_NAME, [b"{}"])
        store.commit(staging, step)
    listed = dict(store.checkpoints())
    for step in Retention(1).doomed(listed):
        store.delete(listed[step])
    assert [step for step, _ in store.checkpoints()] == [3]
    assert sorted(PurePosixPath(p).parent.name for p in store.fs.find(str(store._base))) == ["step_000000003"] * 2


def _restored_step(local: Path, remote: str) -> tuple[int, dict]:
    model = make_model(seed=5)
    with cf.Checkpointer(
        local, remote=remote, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)
    ) as ckpt:
        return ckpt.restore(), model.state_dict()


def test_tiers_restore_newest_of_either(tmp_path: Path, memory_url: str) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    states = {}
    with cf.Checkpointer(
        tmp_path / "fast", remote=memory_url, remote_keep=2, policy=1, keep=2, model=model, optimizer=opt
    ) as ckpt:
        for step in (1, 2, 3):
            _train(ckpt, model, opt, 1)
            ckpt.wait(remote=True)  # each upload done before the next commit: none is skipped
            states[step] = {k: v.clone() for k, v in model.state_dict().items()}
    remote = FsspecStore(memory_url, create=False)
    assert [step for step, _ in remote.checkpoints()] == [3, 2]
    assert [p.name for p in sorted((tmp_path / "fast").glob("step_*"))] == ["step_000000002", "step_000000003"]

    remote.delete(remote.checkpoints()[0][1])  # the remote tier now lags: its newest is step 2
    step, state = _restored_step(tmp_path / "fast", memory_url)
    assert step == 3
    assert_state_equal(state, states[3])
    step, state = _restored_step(tmp_path / "elsewhere", memory_url)
    assert step == 2
    assert_state_equal(state, states[2])


def _restore_event(directory: Path) -> dict:
    events = [json.loads(line) for line in (directory / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e["event"] == "restore"][-1]


def test_damaged_local_file_is_read_from_the_remote_copy(tmp_path: Path, memory_url: str) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with cf.Checkpointer(tmp_path, remote=memory_url, policy=1, model=model, optimizer=opt) as ckpt:
        _train(ckpt, model, opt, 2)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    data = tmp_path / "step_000000002" / "rank00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    step, state = _restored_step(tmp_path, memory_url)
    assert step == 2  # not step 1: only the local copy of one file is damaged
    assert_state_equal(state, expected)
    assert _restore_event(tmp_path)["tier"] == "remote"


class Unreachable(FsspecStore):
    """A remote store that accepts no file."""

    def write_file(self, staging: PurePosixPath, name: str, chunks: object) -> None:
        raise OSError("remote unreachable")


def test_failed_upload_leaves_the_local_commit_durable_and_retained(tmp_path: Path, memory_url: str) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = cf.Checkpointer(
        tmp_path, remote=Unreachable(memory_url), policy=1, keep=1, on_error="warn", model=model, optimizer=opt
    )
    for _ in range(3):
        _train(ckpt, model, opt, 1)
        ckpt.wait()
    with pytest.raises(cf.PersistError, match="copying a checkpoint to memory://"):
        ckpt.close()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "commit"] == [1, 2, 3]  # every local commit counted as durable
    assert [p.name for p in tmp_path.glob("step_*")] == ["step_000000003"]  # and local retention ran
