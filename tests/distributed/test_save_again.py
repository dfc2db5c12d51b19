"""``save()`` takes the current step again when the state changed since its checkpoint, on every
rank when any rank's did: a value set on rank 0 alone after the checkpoint (a best score computed
there) makes both ranks take the step again, and the checkpoint then holds it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

import checkfreq as cf
from checkfreq.run.events import read_events
from helpers import make_model, spawn_ranks, train_step


def _ranks(rank: int, store: str, directory: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with cf.Checkpointer(
        directory, policy=2, persist_timeout=60, failure_timeout=10, model=model, optimizer=opt, values={"best": 0.0}
    ) as ckpt:
        for _ in range(2):
            train_step(model, opt)
            ckpt.step()
        ckpt.save(blocking=True)  # nothing changed since the policy's checkpoint at 2
        if rank == 0:
            ckpt["best"] = 7.0  # on rank 0 alone
        ckpt.save(blocking=True)
    with cf.Checkpointer(directory, model=make_model(1), optimizer=opt, values={"best": 0.0}) as again:
        restored = again.restore()
        Path(f"{out}.{rank}").write_text(json.dumps({"step": restored, "best": again["best"]}))
    dist.destroy_process_group()


def test_a_value_changed_on_one_rank_makes_every_rank_save_the_step_again(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    spawn_ranks(_ranks, (str(tmp_path / "store"), str(directory), str(tmp_path / "out")), 2)
    assert json.loads((tmp_path / "out.0").read_text()) == {"step": 2, "best": 7.0}
    snapshots = [(e["rank"], e["step"]) for e in read_events(directory) if e["event"] == "snapshot"]
    assert sorted(snapshots) == [(0, 2), (0, 2), (1, 2), (1, 2)]
