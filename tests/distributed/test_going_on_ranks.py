"""Two real gloo ranks go on from an older checkpoint (``restore(step=6)``, with another learning rate):
the newer checkpoints, of the course left, are set aside in a shared directory by its leader and in
node-local directories by each, so that the next job's ``restore()`` resumes both ranks from the new
course's newest, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from checkfreq import Checkpointer
from checkfreq.storage.base import Aside
from checkfreq.storage.local import LocalStore
from helpers import assert_state_equal, make_model, spawn_ranks, train_step


def _run(rank: int, root: str, name: str, restore: int | None, steps: int, lr: float, own: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{root}/store-{name}", 2), rank=rank, world_size=2)
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    directory = f"{root}/run{rank if own else ''}"
    with Checkpointer(directory, policy=2, keep=3, model=model, optimizer=optimizer) as ckpt:
        step = ckpt.restore() if restore is None else ckpt.restore(step=restore)
        for _ in range(steps):
            train_step(ddp, optimizer)
            ckpt.step()
    torch.save(model.state_dict(), f"{root}/{name}-rank{rank}.pt")
    Path(f"{root}/{name}-rank{rank}.json").write_text(json.dumps({"restored": step}))
    dist.destroy_process_group()


@pytest.mark.parametrize("own", [False, True], ids=["shared directory", "node-local directories"])
def test_the_next_job_resumes_every_rank_from_the_new_course(tmp_path: Path, own: bool) -> None:
    spawn_ranks(_run, (str(tmp_path), "first", None, 10, 0.1, own), 2)  # keeps 6, 8, 10
    spawn_ranks(_run, (str(tmp_path), "back", 6, 2, 0.5, own), 2)  # a new course: step 8 again
    spawn_ranks(_run, (str(tmp_path), "next", None, 0, 0.5, own), 2)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"next-rank{rank}.json").read_text()) == {"restored": 8}
        assert_state_equal(torch.load(tmp_path / f"next-rank{rank}.pt"), torch.load(tmp_path / f"back-rank{rank}.pt"))
    for directory in [tmp_path / "run0", tmp_path / "run1"] if own else [tmp_path / "run"]:
        store = LocalStore(directory, create=False)
        assert [step for step, _ in store.checkpoints()] == [8, 6]
        assert [(a.step, a.kind) for a in store.set_aside_checkpoints()] == [
            (10, Aside.ABANDONED),
            (8, Aside.ABANDONED),
        ]
