"""Two real gloo ranks, a byte flipped in rank 1's file of the middle checkpoint, which the restore never
reads. Sharing one directory, its leader (rank 0) reads back every rank's file of the checkpoints that
hold a slot before retention deletes one; with a directory each (node-local), each leader reads back
its own files, and what one finds damaged the other sets aside too. Either way the damaged checkpoint
is set aside and the valid oldest survives (``keep=3`` keeps three checkpoints that restore)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from checkfreq import Checkpointer
from checkfreq.storage.format import checkpoint_name
from checkfreq.storage.local import LocalStore
from checkfreq.tools.catalog import list_checkpoints
from helpers import make_model, spawn_ranks, train_step


def _run(rank: int, root: str, name: str, restore: bool, steps: int, own: bool = False) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(filename=f"{root}/{name}-rank{rank}.log", level=logging.WARNING, force=True)
    dist.init_process_group("gloo", store=dist.FileStore(f"{root}/store-{name}", 2), rank=rank, world_size=2)
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(f"{root}/run{rank if own else ''}", policy=2, keep=3, model=model, optimizer=optimizer)
    step = ckpt.restore() if restore else 0
    for _ in range(steps):
        train_step(ddp, optimizer)
        ckpt.step()
    ckpt.close()
    Path(f"{root}/{name}-rank{rank}.json").write_text(json.dumps({"restored": step}))
    dist.destroy_process_group()


def test_the_leader_reads_back_every_ranks_file_before_retention_deletes(tmp_path: Path) -> None:
    spawn_ranks(_run, (str(tmp_path), "first", False, 6), 2)  # checkpoints at 2, 4, 6
    run = tmp_path / "run"
    data = run / checkpoint_name(4) / "rank00001.safetensors"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    spawn_ranks(_run, (str(tmp_path), "second", True, 2), 2)  # restores 6, then a checkpoint at 8
    for rank in (0, 1):
        assert json.loads((tmp_path / f"second-rank{rank}.json").read_text()) == {"restored": 6}
    logs = [(tmp_path / f"second-rank{rank}.log").read_text() for rank in (0, 1)]
    assert logs[0].count("read back before retention") == 1 and "set aside" not in logs[1]
    assert [(s.step, s.valid) for s in list_checkpoints(run)] == [(8, True), (6, True), (2, True)]
    assert len(list(run.glob(f"{checkpoint_name(4)}.damaged-*"))) == 1


def _flip(data: Path) -> None:
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def test_node_local_leaders_read_back_their_own_files_and_set_aside_what_either_found(tmp_path: Path) -> None:
    spawn_ranks(_run, (str(tmp_path), "first", False, 6, True), 2)  # checkpoints at 2, 4, 6 in run0 and run1
    _flip(tmp_path / "run1" / checkpoint_name(4) / "rank00001.safetensors")
    spawn_ranks(_run, (str(tmp_path), "second", True, 2, True), 2)  # restores 6, then a checkpoint at 8
    logs = [(tmp_path / f"second-rank{rank}.log").read_text() for rank in (0, 1)]
    assert "read back before retention" in logs[1] and "found damaged in another directory" in logs[0]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"second-rank{rank}.json").read_text()) == {"restored": 6}
        run = tmp_path / f"run{rank}"
        assert [step for step, _ in LocalStore(run, create=False).checkpoints()] == [8, 6, 2]
        assert len(list(run.glob(f"{checkpoint_name(4)}.damaged-*"))) == 1
