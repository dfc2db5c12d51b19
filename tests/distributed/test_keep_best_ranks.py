"""Keep-best on two gloo ranks: each rank logs its own value of the metric (a rank's shard of an
evaluation, say); the checkpoint's score is rank 0's, never another rank's, in its manifest, and
retention and ``restore(step="best")`` rank by it on every rank."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

import checkfreq as cf
from checkfreq.storage.format import Manifest
from helpers import make_model, spawn_ranks, train_step

RANK0 = {3: 0.9, 6: 0.2, 9: 0.7, 12: 0.5}
"""Rank 0's val_loss logged at each step; rank 1 logs 10 minus it (its best would be the worst)."""


def _ranks(rank: int, store: str, directory: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    keep = cf.Retention(1, best=("val_loss", "min"), top=2)
    with cf.Checkpointer(
        directory, policy=100, keep=keep, persist_timeout=60, failure_timeout=10, model=model, optimizer=opt
    ) as ckpt:
        for step in range(1, 13):
            train_step(model, opt)
            ckpt.step()
            if step in RANK0:
                ckpt.log(val_loss=RANK0[step] if rank == 0 else 10 - RANK0[step])
    with cf.Checkpointer(directory, model=make_model(1), optimizer=opt, keep=keep) as again:
        Path(f"{out}.{rank}").write_text(json.dumps({"best": again.restore(step="best")}))
    dist.destroy_process_group()


def test_the_score_is_rank_0s_on_every_rank(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    spawn_ranks(_ranks, (str(tmp_path / "store"), str(directory), str(tmp_path / "out")), 2)
    scores = {}
    for path in directory.glob("step_*"):
        manifest = Manifest.from_json((path / "manifest.json").read_bytes())
        assert manifest.score is not None
        scores[manifest.step] = manifest.score["value"]
    assert scores == {6: 0.2, 12: 0.5}  # the newest (12) and the two best by rank 0's values (6, 12); by rank 1's: 3, 9
    assert [json.loads((tmp_path / f"out.{rank}").read_text())["best"] for rank in (0, 1)] == [6, 6]
