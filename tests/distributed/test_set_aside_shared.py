"""Two real gloo ranks sharing one directory: the newest checkpoint damaged, the ranks agree to skip it,
only the directory's leader sets it aside, and training on with ``keep=3`` keeps three valid checkpoints."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from typer.testing import CliRunner

from checkfreq import Checkpointer
from checkfreq.cli import app
from checkfreq.storage.format import checkpoint_name
from checkfreq.tools.catalog import list_checkpoints
from helpers import make_model, spawn_ranks, train_step


def _run(rank: int, root: str, name: str, restore: bool, steps: int, every: int) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(filename=f"{root}/{name}-rank{rank}.log", level=logging.WARNING, force=True)
    dist.init_process_group("gloo", store=dist.FileStore(f"{root}/store-{name}", 2), rank=rank, world_size=2)
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(f"{root}/run", policy=every, keep=3, model=model, optimizer=optimizer)
    step = ckpt.restore() if restore else 0
    for _ in range(steps):
        train_step(ddp, optimizer)
        ckpt.step()
    ckpt.close()
    Path(f"{root}/{name}-rank{rank}.json").write_text(json.dumps({"restored": step}))
    dist.destroy_process_group()


def test_only_the_leader_sets_aside_and_keep_counts_valid_checkpoints(tmp_path: Path) -> None:
    spawn_ranks(_run, (str(tmp_path), "first", False, 6, 2), 2)  # checkpoints at 2, 4, 6
    run = tmp_path / "run"
    data = run / checkpoint_name(6) / "rank00001.safetensors"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 100)
    spawn_ranks(_run, (str(tmp_path), "second", True, 6, 3), 2)  # restores 4, then checkpoints at 7 and 10
    for rank in (0, 1):
        assert json.loads((tmp_path / f"second-rank{rank}.json").read_text()) == {"restored": 4}
    logs = [(tmp_path / f"second-rank{rank}.log").read_text() for rank in (0, 1)]
    assert logs[0].count("set aside as") == 1 and "set aside" not in logs[1]
    assert [s.step for s in list_checkpoints(run) if s.valid] == [10, 7, 4]
    assert len(list(run.glob("step_000000006.damaged-*"))) == 1
    result = CliRunner().invoke(app, ["ls", str(run)], env={"COLUMNS": "300"})
    assert result.exit_code == 0 and "3 valid, 0 invalid, 1 set aside" in result.output, result.output
