"""Every policy under DDP, across a restore: which steps each rank checkpoints at.

``torchrun --nproc-per-node 2 ddp_policies.py DIR --steps S``: for each policy of
:data:`POLICIES`, a first session trains S steps into ``DIR/<policy>`` and closes; a second
restores it and trains S more. Each rank writes ``DIR/rank<r>.json``: per policy, the steps at
which ``step()`` started a checkpoint in each session, the restored step and the restore event,
and under ``"groups"`` how many process groups the process held before the first Checkpointer
and after the last one closed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world  # the process groups this process holds
from worker_exit import exit_without_teardown  # beside this script

from checkfreq import Checkpointer
from checkfreq.policies import Auto, ConvergenceAware, Every, Overhead, YoungDaly
from checkfreq.run.events import read_events

POLICIES = {
    "Overhead": lambda: Overhead(p=0.2),
    "Auto": lambda: Auto(p=0.2),
    "YoungDaly": lambda: YoungDaly(mtbf=0.5),
    "ConvergenceAware": lambda: ConvergenceAware(mtbf=0.5, horizon=2.0, refit_every=16),
    "Every(seconds)": lambda: Every(seconds=0.2),
}
STEP_S = 0.002
"""Each step lasts at least this long, so that a session of 400 steps spans 0.8 s or more on any
machine: past the time policy's 0.2 s and the quarter second the ranks may take to agree on it."""


def session(
    directory: Path,
    name: str,
    steps: int,
    net: torch.nn.Module,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    restore: bool,
) -> dict[str, object]:
    ckpt = Checkpointer(directory, policy=POLICIES[name](), keep=2, model=model, optimizer=opt)
    restored = ckpt.restore() if restore else 0
    taken = []
    for _ in range(steps):
        time.sleep(STEP_S)
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if ckpt.step(loss=loss.item()):
            taken.append(ckpt.global_step)
    ckpt.close()
    return {"restored": restored, "taken": taken}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", type=Path)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    net = torch.nn.parallel.DistributedDataParallel(model)
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    results: dict[str, object] = {}
    groups_before = len(_world.pg_map)
    for name in POLICIES:
        directory = args.directory / name
        first = session(directory, name, args.steps, net, model, opt, x, y, restore=False)
        resumed = session(directory, name, args.steps, net, model, opt, x, y, restore=True)
        restore_event = [e for e in read_events(directory) if e["event"] == "restore"][-1]
        results[name] = {"first": first, "resumed": resumed, "seeded": restore_event["seeded"]}
    results["groups"] = [groups_before, len(_world.pg_map)]
    (args.directory / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
