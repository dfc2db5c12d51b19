"""A world of one is a cluster of one: a run that moves from one process to a 1-rank
torch.distributed job (real gloo) and back, resuming each time from the other's checkpoint in one
directory, ends bit-identical to a run never interrupted, with and without a memory tier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from checkfreq import Checkpointer
from checkfreq.run.events import read_events
from helpers import assert_state_equal, make_model, spawn_ranks, train_step

LEG = 4
"""Optimizer steps per session."""


def _session(directory: str, out: str, memory: bool) -> None:
    """Restore the newest checkpoint in ``directory`` (none at first), train ``LEG`` steps, checkpoint,
    and save what was trained to ``out``."""
    model = make_model(seed=1)  # not the saved weights: restore must bring them
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    with Checkpointer(
        directory, policy=1000, memory=memory, model=model, optimizer=optimizer, values={"sessions": 0}
    ) as ckpt:
        start = ckpt.restore()
        if start == 0:
            torch.manual_seed(0)  # a fresh run: the data of the uninterrupted one
        for _ in range(LEG):
            train_step(model, optimizer)
            ckpt.step()
        ckpt["sessions"] += 1
        ckpt.save(blocking=True)
        torch.save(
            {
                "step": ckpt.global_step,
                "sessions": ckpt["sessions"],
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
            },
            out,
        )


def _one_rank_session(rank: int, directory: str, out: str, memory: bool, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=rank, world_size=1)
    try:
        _session(directory, out, memory)
    finally:
        dist.destroy_process_group()


def _uninterrupted(steps: int) -> dict:
    model = make_model(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    torch.manual_seed(0)
    for _ in range(steps):
        train_step(model, optimizer)
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def _manifest(directory: Path, step: int) -> dict:
    return json.loads((directory / f"step_{step:09d}" / "manifest.json").read_text())


@pytest.mark.parametrize("memory", [False, True], ids=["disk", "memory"])
def test_one_process_and_a_one_rank_job_resume_each_other_bit_identically(
    tmp_path: Path, shm_dir: Path, memory: bool
) -> None:
    directory = tmp_path / "run"
    _session(str(directory), str(tmp_path / "first.pt"), memory)  # one process
    # torch.distributed, one rank: resumes the one process's checkpoint
    spawn_ranks(_one_rank_session, (str(directory), str(tmp_path / "second.pt"), memory, str(tmp_path / "store")), 1)
    _session(str(directory), str(tmp_path / "third.pt"), memory)  # one process again: resumes the 1-rank job's

    # each session wrote its own kind of checkpoint: the 1-rank job's indexes its rank's share
    assert [_manifest(directory, s).get("distributed") is not None for s in (LEG, 2 * LEG, 3 * LEG)] == [
        False,
        True,
        False,
    ]
    events = read_events(directory)
    assert [(e["step"], e["tier"], e["world_size"]) for e in events if e["event"] == "restore"] == [
        (LEG, "local", 1),
        (2 * LEG, "local", 1),
    ]
    if memory:  # every session snapshotted to memory, the 1-rank job's at the cadence it measured
        assert {(e["step"] - 1) // LEG for e in events if e["event"] == "memory"} == {0, 1, 2}
    for session, name in enumerate(("first", "second", "third"), start=1):
        trained = torch.load(tmp_path / f"{name}.pt")
        assert (trained["step"], trained["sessions"]) == (session * LEG, session)
        reference = _uninterrupted(session * LEG)
        assert_state_equal(trained["model"], reference["model"])
        assert_state_equal(trained["optimizer"], reference["optimizer"])
