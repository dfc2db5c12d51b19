"""The memory tier under a real 2-rank torchrun job: a killed job restarts from shared memory,
bit-identical; a rank that lost its region makes both ranks fall back to a common disk step."""

from __future__ import annotations

import re
import shutil
import uuid
from pathlib import Path

import pytest
import torch

from checkfreq.storage.shm_paths import SHM_DIR_ENV
from helpers import assert_state_equal, ddp_train_args, finish_job, launch_job

pytestmark = pytest.mark.slow
MEMORY = ("--every", "4", "--memory", "1", "--die", "0:0:6:step")  # persists at 4, 8, 12; rank 0 dies after step 6


def _restored(out: str, life: int) -> set[int]:
    return {int(step) for lf, step in re.findall(r"life=(\d+) rank=\d+ restored step=(\d+)", out) if int(lf) == life}


def test_torchrun_restarts_from_memory_or_falls_back_to_disk_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shm = Path("/dev/shm") / f"checkfreq-test-{uuid.uuid4().hex[:8]}"
    shm.mkdir()
    monkeypatch.setenv(SHM_DIR_ENV, str(shm))
    try:
        reference, memory, dropped = (tmp_path / name for name in ("reference", "memory", "dropped"))
        for path in (reference, memory, dropped):
            path.mkdir()
        procs = [
            launch_job(reference, "ddp_train.py", *ddp_train_args(reference, "--every", "4")),
            launch_job(memory, "ddp_train.py", *ddp_train_args(memory, *MEMORY)),
            launch_job(dropped, "ddp_train.py", *ddp_train_args(dropped, *MEMORY, "--drop-region", "1:1")),
        ]
        outs = dict(zip(("reference", "memory", "dropped"), (finish_job(p) for p in procs), strict=True))
        # both ranks restore the same step: 6, or 5 if rank 1 was killed before its snapshot of 6 was complete
        restored = _restored(outs["memory"], life=1)
        assert len(restored) == 1 and restored <= {5, 6}, outs["memory"][-3000:]
        assert _restored(outs["dropped"], life=1) == {4}, outs["dropped"][-3000:]  # rank 1's region is gone: disk
        for rank in (0, 1):  # every rank's model, buffers, optimizer and values
            expected = torch.load(reference / f"final.rank{rank}.pt")
            for run in (memory, dropped):
                assert_state_equal(torch.load(run / f"final.rank{rank}.pt"), expected)
        assert not any(shm.iterdir())  # a clean close removes every rank's region
    finally:
        shutil.rmtree(shm, ignore_errors=True)
