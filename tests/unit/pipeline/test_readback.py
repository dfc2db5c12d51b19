"""Retention reads back the checkpoints that hold a slot before it deletes one in their favour: damage
nothing has read yet never takes a valid checkpoint's place (``keep=n`` keeps n checkpoints that restore).

Real runs on real files, real damage (a byte flipped in a data file)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import checkfreq as cf
from checkfreq.pipeline.retention.readback import ReadBack, Sifted
from checkfreq.pipeline.retention.retainer import retain
from checkfreq.policies.retention import Retention
from checkfreq.storage import LocalStore
from checkfreq.storage.format import checkpoint_name
from checkfreq.tools.catalog import list_checkpoints
from helpers import make_model, tmpfs, train_step

DATA = "rank00000.safetensors"


def _run(directory: Path, steps: int, *, restore: bool) -> int:
    """``steps`` steps with a checkpoint every 5 and ``keep=3``; the step restored (0: none)."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with cf.Checkpointer(directory, policy=5, keep=3, model=model, optimizer=opt) as ckpt:
        start = ckpt.restore() if restore else 0
        for _ in range(steps):
            train_step(model, opt)
            ckpt.step()
    return start or 0


def _flip(checkpoint: Path) -> None:
    data = checkpoint / DATA
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_damage_nothing_has_read_never_takes_a_valid_checkpoints_place(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _run(run, 20, restore=False)  # checkpoints 10, 15, 20 kept
    assert [s.step for s in list_checkpoints(run)] == [20, 15, 10]
    _flip(run / checkpoint_name(15))  # the middle one: the restore reads only 20

    assert _run(run, 5, restore=True) == 20  # then a checkpoint at 25, and retention

    statuses = list_checkpoints(run)
    assert [(s.step, s.valid) for s in statuses] == [(25, True), (20, True), (10, True)]
    aside = list(run.glob(f"{checkpoint_name(15)}.damaged-*"))
    assert len(aside) == 1 and "fails its checksum" in (aside[0] / "damaged.json").read_text()

    # the newest lost (its write killed) and the next one damaged: the oldest valid one restores
    shutil.rmtree(run / checkpoint_name(25))
    _flip(run / checkpoint_name(20))
    assert _run(run, 0, restore=True) == 10


def test_each_checkpoint_is_read_back_once_and_a_retake_again(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _run(run, 10, restore=False)
    store = LocalStore(run, create=False)
    readback = ReadBack(store)
    listed = dict(store.checkpoints())
    size = (run / checkpoint_name(10) / DATA).stat().st_size
    assert readback.sift(listed) is Sifted.SOUND and readback.bytes_read == 2 * size
    assert readback.sift(listed) is Sifted.SOUND and readback.bytes_read == 2 * size  # read once
    _flip(run / checkpoint_name(10))
    assert readback.sift(listed) is Sifted.SOUND  # damage after the read: not read again in this process
    assert readback.sift(listed, fresh={10}) is Sifted.DAMAGED  # committed again at its step: read again
    assert [step for step, _ in store.checkpoints()] == [5]
    assert [a.step for a in store.set_aside_checkpoints()] == [10]


def test_a_checkpoint_that_cannot_be_set_aside_stops_retention_rather_than_loops(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ro", "16m") as root:
        run = root / "run"
        _run(run, 20, restore=False)
        _flip(run / checkpoint_name(15))
        if subprocess.run(["mount", "-o", "remount,ro", str(root)], capture_output=True).returncode:
            pytest.skip("cannot remount the tmpfs read-only here")
        store = LocalStore(run, create=False)
        readback = ReadBack(store)
        listed = dict(store.checkpoints())
        assert readback.sift(listed) is Sifted.DAMAGED  # found, but left in place: still listed
        assert readback.sift(listed) is Sifted.UNREAD  # so nothing is deleted in its favour
        retain(store, Retention(2), readback=readback)  # returns, deleting nothing
        assert [step for step, _ in store.checkpoints()] == [20, 15, 10]
