"""The overhead loop under DDP and the default policy: killed in its first life, measured after torchrun restarts it.

``torchrun --nproc-per-node 2 --max-restarts 1 ddp_sessions.py DIR --kill-at K --reps R --steps S``:

* life 0 warms up, trains with ``Checkpointer(DIR/killed, ...)`` and rank 0 SIGKILLs itself after step K;
* life 1 (the restart) measures :func:`overhead_loop.resumed_sessions` on copies of ``DIR/killed``.

Every rank appends JSON lines to ``DIR/rank<r>.jsonl`` (its own file: torchrun interleaves the
ranks' stdout): ``{"life", "rank", "checkpoint": step}`` for each checkpoint of life 0 and
``{"life", "rank", "sessions": {...}}`` at the end of life 1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from overhead_loop import resumed_sessions, setup, train  # beside this script
from worker_exit import exit_without_teardown  # beside this script

from checkfreq import Checkpointer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory", type=Path)
    parser.add_argument("--kill-at", type=int, required=True)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, life = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    model, opt, x, y = setup()
    net = torch.nn.parallel.DistributedDataParallel(model)
    killed = args.directory / "killed"

    def say(**fields: object) -> None:
        with open(args.directory / f"rank{rank}.jsonl", "a") as out:
            out.write(json.dumps({"life": life, "rank": rank, **fields}) + "\n")

    if life == 0:
        train(30, None, net, opt, x, y)  # warm up, as resumed_sessions does before what it compares with
        ckpt = Checkpointer(killed, keep=2, model=model, optimizer=opt)
        while True:
            loss = torch.nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if ckpt.step():
                say(checkpoint=ckpt.global_step)
            if ckpt.global_step >= args.kill_at and rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
    runs = resumed_sessions(
        killed,
        args.directory,
        args.reps,
        args.steps,
        model,
        opt,
        x,
        y,
        forward=net,
        leader=rank == 0,
        barrier=dist.barrier,
    )
    say(sessions=runs.as_dict())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
