"""Damaged checkpoints set aside: a restore that skips one, ``checkfreq verify`` that fails one, and
retention that never keeps one in place of a valid one (``keep=n`` keeps n checkpoints that restore).

Real runs, real damage (a truncated or flipped data file), the real ``checkfreq`` commands."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import checkfreq as cf
from checkfreq.cli import app
from checkfreq.storage import FsspecStore, LocalStore, open_store
from checkfreq.storage.base import DAMAGED_NAME
from checkfreq.storage.format import MANIFEST_NAME, checkpoint_name
from checkfreq.tools.aside import set_aside_statuses
from checkfreq.tools.catalog import list_checkpoints
from helpers import make_model, tmpfs, train_step

DATA = "rank00000.safetensors"


def _stack(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model(seed)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(ckpt: cf.Checkpointer, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        train_step(model, opt)
        ckpt.step()
    ckpt.wait()


def _first_run(directory: str | Path) -> None:
    """Checkpoints at steps 2, 4 and 6 (``keep=3``)."""
    model, opt = _stack()
    with cf.Checkpointer(directory, policy=2, keep=3, model=model, optimizer=opt) as ckpt:
        _train(ckpt, model, opt, 6)


def _truncate(checkpoint: Path) -> None:
    data = checkpoint / DATA
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 100)


def _flip(checkpoint: Path) -> None:
    data = checkpoint / DATA
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def _cli(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "300"})
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def _valid_steps(directory: str | Path) -> list[int]:
    return [s.step for s in list_checkpoints(directory) if s.valid]


@pytest.fixture
def memory_url() -> str:
    return f"memory://checkfreq-test-{uuid.uuid4().hex[:12]}/run"


def test_a_skipped_damaged_checkpoint_never_holds_a_retention_slot(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The newest checkpoint's data file is truncated: the restore skips it and resumes from the one
    before; it is set aside (logged once, naming it and why), and training on with ``keep=3`` keeps the
    three newest *valid* checkpoints, never the damaged one in place of a valid one."""
    _first_run(tmp_path)
    _truncate(tmp_path / checkpoint_name(6))
    model, opt = _stack(seed=1)
    with (
        caplog.at_level(logging.WARNING, logger="checkfreq"),
        cf.Checkpointer(tmp_path, policy=3, keep=3, model=model, optimizer=opt) as ckpt,
    ):
        assert ckpt.restore() == 4
        set_aside = [r.message for r in caplog.records if "set aside" in r.message]
        assert len(set_aside) == 1 and checkpoint_name(6) in set_aside[0] and "bytes" in set_aside[0]
        assert [s for s, _ in LocalStore(tmp_path).checkpoints()] == [4, 2]
        _train(ckpt, model, opt, 6)  # checkpoints at 7 and 10
        assert _valid_steps(tmp_path) == [10, 7, 4]  # before: 10, 7 and the damaged 6
        code, out = _cli("ls", tmp_path)
        assert code == 0 and "3 valid, 0 invalid, 1 set aside" in out and "set aside as step_000000006.damaged-" in out
        listing = json.loads(_cli("ls", tmp_path, "--json")[1])
        assert [(c["step"], c["valid"], c["set_aside"] is not None) for c in listing] == [
            (10, True, False),
            (7, True, False),
            (6, False, True),
            (4, True, False),
        ]
        assert "bytes" in listing[2]["reason"]
        _train(ckpt, model, opt, 3)  # a checkpoint at 13: three valid ones are newer than the damaged 6
    assert _valid_steps(tmp_path) == [13, 10, 7]
    assert set_aside_statuses(tmp_path) == [] and not list(tmp_path.glob("step_*.damaged-*"))
    # The process a user runs: the listing counts only valid checkpoints.
    proc = subprocess.run(
        [sys.executable, "-m", "checkfreq.cli", "ls", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "3 valid, 0 invalid" in proc.stdout, proc.stdout + proc.stderr


def test_a_set_aside_checkpoint_keeps_its_files_and_can_be_put_back(tmp_path: Path) -> None:
    _first_run(tmp_path)
    _flip(tmp_path / checkpoint_name(6))
    model, opt = _stack(seed=1)
    with cf.Checkpointer(tmp_path, model=model, optimizer=opt) as ckpt:
        assert ckpt.restore() == 4
    (aside,) = tmp_path.glob("step_000000006.damaged-*")
    assert {p.name for p in aside.iterdir()} == {MANIFEST_NAME, DATA, DAMAGED_NAME}
    record = json.loads((aside / DAMAGED_NAME).read_text())
    assert "checksum" in record["reason"] and record["pid"] > 0
    # The restore ran once: a second one finds nothing to skip and sets nothing more aside.
    with cf.Checkpointer(tmp_path, model=model, optimizer=opt) as ckpt:
        assert ckpt.restore() == 4
    assert len(list(tmp_path.glob("step_*.damaged-*"))) == 1
    # Putting it back is a rename (here after mending the byte): the restore takes it again.
    _flip(aside)
    aside.rename(tmp_path / checkpoint_name(6))
    with cf.Checkpointer(tmp_path, model=model, optimizer=opt) as ckpt:
        assert ckpt.restore() == 6


def test_a_step_written_again_stands_beside_the_one_set_aside(tmp_path: Path) -> None:
    _first_run(tmp_path)
    _truncate(tmp_path / checkpoint_name(6))
    model, opt = _stack(seed=1)
    with cf.Checkpointer(tmp_path, policy=2, keep=3, model=model, optimizer=opt) as ckpt:
        assert ckpt.restore() == 4
        _train(ckpt, model, opt, 2)  # step 6 again
    assert _valid_steps(tmp_path) == [6, 4, 2]
    assert [s.step for s in set_aside_statuses(tmp_path)] == [6]


def test_nothing_is_set_aside_when_no_checkpoint_restores(tmp_path: Path) -> None:
    """Every checkpoint damaged (as a storage outage would make them look): the restore fails loudly and
    leaves them listed, rather than setting all aside and letting the next launch start afresh."""
    _first_run(tmp_path)
    for step in (2, 4, 6):
        _flip(tmp_path / checkpoint_name(step))
    model, opt = _stack(seed=1)
    with cf.Checkpointer(tmp_path, model=model, optimizer=opt) as ckpt:
        with pytest.raises(cf.NoValidCheckpointError):
            ckpt.restore()
    assert [s for s, _ in LocalStore(tmp_path).checkpoints()] == [6, 4, 2]
    assert not list(tmp_path.glob("step_*.damaged-*"))


def test_an_object_store_marks_a_skipped_checkpoint_and_retention_counts_only_valid_ones(memory_url: str) -> None:
    _first_run(memory_url)
    store = FsspecStore(memory_url)
    location = store.location(6)
    raw = store.fs.cat_file(str(location / DATA))
    store.fs.pipe_file(str(location / DATA), raw[:-100])  # truncated
    model, opt = _stack(seed=1)
    with cf.Checkpointer(memory_url, policy=3, keep=3, model=model, optimizer=opt) as ckpt:
        assert ckpt.restore() == 4
        assert store.fs.exists(str(location / DAMAGED_NAME)) and store.fs.exists(str(location / MANIFEST_NAME))
        _train(ckpt, model, opt, 6)  # checkpoints at 7 and 10
        assert _valid_steps(memory_url) == [10, 7, 4]
        assert [(s.name, s.set_aside) for s in set_aside_statuses(memory_url)] == [
            (checkpoint_name(6), checkpoint_name(6))
        ]
        assert "3 valid, 0 invalid, 1 set aside" in _cli("ls", memory_url)[1]
    # A new writer clears uncommitted leftovers: a checkpoint set aside is committed, and stays.
    with cf.Checkpointer(memory_url, model=make_model(), keep=3) as ckpt:
        ckpt.restore()
    assert [s.step for s in set_aside_statuses(memory_url)] == [6]


def test_an_object_store_marker_hides_only_the_manifest_it_was_written_for(memory_url: str) -> None:
    _first_run(memory_url)
    store = FsspecStore(memory_url)
    location = store.location(6)
    assert store.set_aside(location, "found damaged") == location
    assert [s for s, _ in store.checkpoints()] == [4, 2]
    (aside,) = store.set_aside_checkpoints()
    assert (aside.step, aside.reason) == (6, "found damaged") and aside.when is not None
    # Another manifest at that step (a checkpoint written there since): the stale marker hides nothing.
    manifest = json.loads(store.fs.cat_file(str(location / MANIFEST_NAME)))
    manifest["created"] += 1
    store.fs.pipe_file(str(location / MANIFEST_NAME), json.dumps(manifest).encode())
    assert [s for s, _ in store.checkpoints()] == [6, 4, 2] and store.set_aside_checkpoints() == []
    # Deleting the marker puts a checkpoint back; writing the step again removes it with the rest.
    store.set_aside(location, "found damaged")
    store.fs.rm_file(str(location / DAMAGED_NAME))
    assert [s for s, _ in store.checkpoints()] == [6, 4, 2]
    store.set_aside(location, "found damaged")
    store.staging_dir(6, "job")
    assert not store.fs.exists(str(location / DAMAGED_NAME))


def test_verify_sets_aside_what_it_fails_and_ls_lists_it_apart(tmp_path: Path) -> None:
    _first_run(tmp_path)
    _truncate(tmp_path / checkpoint_name(6))
    code, out = _cli("verify", tmp_path, "--no-set-aside")
    assert code == 1 and "FAILED step_000000006" in out and "set aside" not in out
    assert _valid_steps(tmp_path) == [4, 2]
    code, out = _cli("verify", tmp_path)
    assert code == 1 and "set aside as step_000000006.damaged-" in out and "2 of 3 checkpoints verified" in out
    assert [s for s, _ in LocalStore(tmp_path).checkpoints()] == [4, 2]
    report = json.loads(_cli("verify", tmp_path, "--json")[1])
    assert report["ok"] is True and [c["step"] for c in report["checkpoints"]] == [4, 2]
    assert [(c["step"], "bytes" in c["reason"]) for c in report["set_aside_before"]] == [(6, True)]
    code, out = _cli("verify", tmp_path)
    assert code == 0 and "set aside earlier step_000000006 as step_000000006.damaged-" in out


def test_verify_leaves_a_running_jobs_directory_alone(tmp_path: Path) -> None:
    _first_run(tmp_path)
    _truncate(tmp_path / checkpoint_name(6))
    model, opt = _stack(seed=1)
    with cf.Checkpointer(tmp_path, model=model, optimizer=opt):  # holds the directory, restores nothing yet
        code, out = _cli("verify", tmp_path)
        assert code == 1 and "a checkfreq job holds" in out and "left in place" in out
        assert [s for s, _ in LocalStore(tmp_path).checkpoints()] == [6, 4, 2]


def test_verify_of_a_single_checkpoint_sets_it_aside(tmp_path: Path) -> None:
    _first_run(tmp_path)
    _flip(tmp_path / checkpoint_name(4))
    code, out = _cli("verify", tmp_path / "step_4")
    assert code == 1 and "checksum" in out and "set aside as step_000000004.damaged-" in out
    assert [s for s, _ in LocalStore(tmp_path).checkpoints()] == [6, 2]


def test_verify_on_a_read_only_directory_reports_and_moves_nothing(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ro", "16m") as root:
        _first_run(root / "run")
        _truncate(root / "run" / checkpoint_name(6))
        if subprocess.run(["mount", "-o", "remount,ro", str(root)], capture_output=True).returncode:
            pytest.skip("cannot remount the tmpfs read-only here")
        code, out = _cli("verify", root / "run")
        assert code == 1 and "FAILED step_000000006" in out and "left in place" in out
        assert [s for s, _ in open_store(root / "run", create=False).checkpoints()] == [6, 4, 2]
        assert _cli("ls", root / "run")[0] == 0


def test_a_directory_holding_only_checkpoints_set_aside_refuses_to_start_afresh(tmp_path: Path) -> None:
    _first_run(tmp_path)
    for step in (6, 4, 2):
        _truncate(tmp_path / checkpoint_name(step))
    assert _cli("verify", tmp_path)[0] == 1  # sets all three aside
    assert _valid_steps(tmp_path) == []
    model, opt = _stack()
    with (
        cf.Checkpointer(tmp_path, model=model, optimizer=opt) as ckpt,
        pytest.raises(cf.errors.NoValidCheckpointError, match="set aside .*new directory"),
    ):
        ckpt.restore()
