"""A machine absent from a restore comes back holding memory snapshots of the course the run left.

Two real gloo ranks, each on a machine of its own (its own shared memory), a shared checkpoint
directory, ``memory=1``, durable checkpoints every 4 steps. The job stops after step 10 (snapshots 9
and 10 in each machine's memory). Machine 1 is away at the next start: a replacement with empty
memory takes its rank, the ranks restore step 8 from disk and go on, with another learning rate, to
step 10 again. Then machine 1 is back: both machines hold snapshots numbered 9 and 10, of two
courses. They are other states; restoring "step 10" from both would give each rank another model.
The restore takes the newest state the ranks share, step 8 on disk, and every rank holds the same.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from checkfreq import Checkpointer
from checkfreq.storage.shm_paths import SHM_DIR_ENV
from helpers import assert_state_equal, make_model, spawn_ranks, train_step

pytestmark = pytest.mark.slow


def _run(rank: int, root: str, name: str, machines: tuple[str, str], steps: int, lr: float) -> None:
    """One start of the job: restore, train ``steps`` steps, then stop as a killed job would (the
    memory snapshots committed, nothing closed, so they stay in each machine's memory)."""
    os.environ[SHM_DIR_ENV] = f"{root}/{machines[rank]}"
    Path(os.environ[SHM_DIR_ENV]).mkdir(exist_ok=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{root}/store-{name}", 2), rank=rank, world_size=2)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("checkfreq").addHandler(handler)
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters())
    ckpt = Checkpointer(f"{root}/run", policy=4, memory=1, model=model, optimizer=optimizer)
    restored = ckpt.restore()
    for group in optimizer.param_groups:  # this start's learning rate, not the restored one
        group["lr"] = lr
    for _ in range(steps):
        train_step(ddp, optimizer)
        ckpt.step()
    ckpt.wait()
    torch.save(model.state_dict(), f"{root}/{name}-rank{rank}.pt")
    result = {"restored": restored, "log": records}
    Path(f"{root}/{name}-rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # both ranks' results written before either leaves


def test_a_machine_back_from_absence_brings_no_snapshot_of_the_course_the_run_left(tmp_path: Path) -> None:
    root = str(tmp_path)
    spawn_ranks(_run, (root, "first", ("shm0", "shm1"), 10, 0.1), 2)  # snapshots 9, 10 on both machines
    spawn_ranks(_run, (root, "away", ("shm0", "replacement"), 2, 0.5), 2)  # step 8 from disk, then 9, 10 again
    spawn_ranks(_run, (root, "back", ("shm0", "shm1"), 0, 0.5), 2)
    away, back = (
        [json.loads((tmp_path / f"{name}-rank{rank}.json").read_text()) for rank in (0, 1)] for name in ("away", "back")
    )
    assert [r["restored"] for r in away] == [8, 8]
    assert [r["restored"] for r in back] == [8, 8], back  # step 10 of two courses is no state to restore
    assert any("of one step and course" in line for line in back[0]["log"]), back[0]["log"]
    states = [torch.load(tmp_path / f"back-rank{rank}.pt") for rank in (0, 1)]
    assert_state_equal(states[0], states[1])  # every rank holds the same model
    assert not torch.equal(  # and the courses did differ at step 10: a mix would have shown
        torch.load(tmp_path / "first-rank1.pt")["0.weight"], torch.load(tmp_path / "away-rank0.pt")["0.weight"]
    )
