"""Under torch.distributed every rank captures the checkpoint the ranks decided together at the
same step, whatever each rank's own objects say: rank 0 alone registers a second loader left at its
epoch's last batch (a one-batch validation loader, peeked), and both ranks still commit the policy's
checkpoints at their steps. Real gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import checkfreq as cf
from checkfreq.data import ResumableLoader
from checkfreq.run.events import read_events
from helpers import spawn_ranks


def _train(rank: int, world: int, workdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{workdir}/store", world), rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    net = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    loader = ResumableLoader(data, batch_size=4)
    extra = {}
    if rank == 0:
        extra["validation"] = ResumableLoader(data, batch_size=32)  # one batch per rank: at its last at once
        next(iter(extra["validation"]))
    with cf.Checkpointer(
        f"{workdir}/run", policy=2, failure_timeout=20.0, model=model, optimizer=opt, loader=loader, **extra
    ) as ckpt:
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
            ckpt.step()
    steps = [e["step"] for e in read_events(f"{workdir}/run") if e["event"] == "snapshot" and e["rank"] == rank]
    Path(f"{workdir}/steps{rank}.json").write_text(json.dumps(steps))
    dist.destroy_process_group()


def test_ranks_capture_the_checkpoints_they_decided_together_whatever_each_ranks_loaders_say(tmp_path: Path) -> None:
    spawn_ranks(_train, (2, str(tmp_path)), 2)
    assert [json.loads((tmp_path / f"steps{rank}.json").read_text()) for rank in range(2)] == [[2, 4]] * 2
    assert sorted(p.name for p in (tmp_path / "run").glob("step_*")) == ["step_000000002", "step_000000004"]
