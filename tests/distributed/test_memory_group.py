"""The memory tier under DDP on one machine: its ranks keep one copy of the replicated state between
them (each snapshot copies about 1/N of it), and a job whose every rank is killed resumes from
those shares, bit-identical, at 2 and 4 ranks."""

from __future__ import annotations

import re
import shutil
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from checkfreq.run.events import read_events
from checkfreq.storage.shm_paths import SHM_DIR_ENV
from helpers import assert_state_equal, ddp_train_args, finish_job, launch_job

pytestmark = pytest.mark.slow


def _memory_bytes(directory: Path) -> dict[int, dict[int, int]]:
    """step → rank → bytes of each rank's memory snapshot of that step."""
    taken: dict[int, dict[int, int]] = defaultdict(dict)
    for record in read_events(directory):
        if record["event"] == "memory":
            taken[record["step"]][record["rank"]] = record["bytes"]
    return taken


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_machine_keeps_one_copy_and_every_rank_resumes_from_it(
    ranks: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shm = Path("/dev/shm") / f"checkfreq-test-{uuid.uuid4().hex[:8]}"
    shm.mkdir()
    monkeypatch.setenv(SHM_DIR_ENV, str(shm))
    die = 5 if ranks == 2 else 3  # steps per epoch: 4 at 2 ranks, 2 at 4
    try:
        alone, reference, killed = (tmp_path / name for name in ("alone", "reference", "killed"))
        for path in (alone, reference, killed):
            path.mkdir()
        procs = [  # --every 100: nothing on disk but the closing checkpoint, every restore is from memory
            launch_job(alone, "ddp_train.py", *ddp_train_args(alone, "--every", "100", "--memory", "1"), nproc=0),
            launch_job(reference, "ddp_train.py", *ddp_train_args(reference, "--every", "100"), nproc=ranks),
            launch_job(
                killed,
                "ddp_train.py",
                *ddp_train_args(killed, "--every", "100", "--memory", "1", "--die", f"0:{ranks - 1}:{die}:step"),
                nproc=ranks,
            ),
        ]
        outs = [finish_job(p) for p in procs]
        found = re.findall(r"life=(\d+) rank=\d+ restored step=(\d+)", outs[2])
        restored = {int(step) for life, step in found if life == "1"}
        # every rank restarted from the newest snapshot they all hold: the one of the step it died at,
        # or the one before if the killed rank's was not complete
        assert len(restored) == 1 and restored <= {die - 1, die}, outs[2][-3000:]
        tiers = {(e["rank"], e["tier"]) for e in read_events(killed / "ckpt") if e["event"] == "restore"}
        assert tiers == {(rank, "memory") for rank in range(ranks)}, tiers
        for rank in range(ranks):
            expected = torch.load(reference / f"final.rank{rank}.pt")
            assert_state_equal(torch.load(killed / f"final.rank{rank}.pt"), expected)

        whole = max(max(by_rank.values()) for by_rank in _memory_bytes(alone / "ckpt").values())
        shares = _memory_bytes(killed / "ckpt")
        full = [by_rank for by_rank in shares.values() if len(by_rank) == ranks]
        assert full, shares
        for by_rank in full:
            # one copy of the replicated state on the machine, not one per rank: the private state
            # (BatchNorm statistics, per-rank values) is under 3 % of the whole here
            assert sum(by_rank.values()) < whole * 1.1, (by_rank, whole)
            assert max(by_rank.values()) < whole / ranks * 1.15, (by_rank, whole)  # each copies about 1/N
        assert not any(shm.iterdir())  # a clean close removes every rank's region
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_fsdp2_ranks_resume_from_their_shards_in_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sharded state (FSDP2 on every layer and the model, AdamW): each rank's slot holds its own shards,
    and every rank killed resumes from them, bit-identical, with nothing on disk."""
    shm = Path("/dev/shm") / f"checkfreq-test-{uuid.uuid4().hex[:8]}"
    shm.mkdir()
    monkeypatch.setenv(SHM_DIR_ENV, str(shm))
    try:
        reference, killed = tmp_path / "reference", tmp_path / "killed"
        for path in (reference, killed):
            path.mkdir()
        common = ("--ckpt-dir", "ckpt", "--final", "final")
        procs = [
            launch_job(reference, "fsdp_memory.py", *common),
            launch_job(killed, "fsdp_memory.py", *common, "--memory", "1", "--die", "0:1:5"),
        ]
        out = [finish_job(p) for p in procs][1]
        found = re.findall(r"life=(\d+) rank=\d+ world=\d+ restored step=(\d+)", out)
        assert {int(step) for life, step in found if life == "1"} in ({4}, {5}), out[-3000:]
        tiers = {(e["rank"], e["tier"]) for e in read_events(killed / "ckpt") if e["event"] == "restore"}
        assert tiers == {(0, "memory"), (1, "memory")}, (tiers, out[-3000:])
        assert "memory tier off" not in out
        for rank in (0, 1):
            expected = torch.load(reference / f"final.rank{rank}.pt")
            assert_state_equal(torch.load(killed / f"final.rank{rank}.pt"), expected)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
