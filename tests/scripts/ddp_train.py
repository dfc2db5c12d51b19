"""A data-parallel training run for the distributed acceptance tests.

Runs under ``torchrun`` (DDP over gloo) or as one plain process. Restores from ``--ckpt-dir`` if a
checkpoint is there, trains to the end (shuffled resumable loader, random augmentation, dropout,
BatchNorm, AdamW, an LR schedule) and rank 0 writes the final state to ``--final``.

* ``--die LIFE:RANK:STEP:MODE,...``: in incarnation LIFE (torchrun's ``TORCHELASTIC_RESTART_COUNT``),
  rank RANK SIGKILLs itself after optimizer step STEP: MODE ``step`` once the checkpoint in flight
  is durable, MODE ``persist`` right after the step started a checkpoint, while it is being written.
* ``--stop-at K``: take a blocking checkpoint at step K and exit cleanly (to resume elsewhere).
* ``--memory N``: the memory tier, a snapshot every N steps; ``--drop-region LIFE:RANK``: in
  incarnation LIFE, rank RANK deletes its memory-tier region before restoring (its node lost it).

Each rank appends its batches to ``--batch-log`` as ``rank epoch consumed index index ...``; a batch
replayed after a restore has the same (rank, epoch, consumed) key and replaces its earlier line.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch import nn

from checkfreq import Checkpointer
from checkfreq.data import ResumableLoader
from checkfreq.storage.shm import region_path
from noisy_points import NoisyPoints  # beside this script


def build_model() -> nn.Module:
    """Uneven layer sizes: the partition has to split tensors to balance the ranks."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Dropout(0.2),
        nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 3),
    )


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--final", required=True)
    parser.add_argument("--batch-log", required=True)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--die", default="", help="LIFE:RANK:STEP:MODE,... (MODE: step or persist)")
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--memory", type=int, default=0)
    parser.add_argument("--drop-region", default="")
    return parser.parse_args()


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    die_at, die_mode = None, "step"
    for spec in filter(None, args.die.split(",")):
        when, who, at, mode = spec.split(":")
        if int(when) == life and int(who) == rank:
            die_at, die_mode = int(at), mode

    model = build_model()
    net = nn.parallel.DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.8)
    loader = ResumableLoader(NoisyPoints(args.samples), batch_size=args.batch_size, shuffle=True, seed=5)
    if args.drop_region == f"{life}:{rank}":
        region_path(args.ckpt_dir, rank).unlink()
    ckpt = Checkpointer(args.ckpt_dir, policy=args.every, keep=2, memory=args.memory or False, model=model,
                        optimizer=optimizer, scheduler=scheduler, loader=loader)
    step = ckpt.restore()
    state = loader.state_dict()
    print(f"life={life} rank={rank} restored step={step} epoch={state['epoch']} consumed={state['consumed']}", flush=True)

    with open(f"{args.batch_log}", "a") as log:
        for epoch in range(loader.epoch, args.epochs):
            for x, y, index in loader:
                log.write(f"{rank} {epoch} {loader.state_dict()['consumed']} {' '.join(map(str, index.tolist()))}\n")
                log.flush()
                loss = nn.functional.cross_entropy(net(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                scheduler.step()
                started = ckpt.step()
                if ckpt.global_step == die_at:
                    if die_mode == "step":
                        ckpt.wait()
                    else:
                        assert started, "MODE persist needs a checkpoint step"
                    os.kill(os.getpid(), signal.SIGKILL)
                if ckpt.global_step == args.stop_at:
                    ckpt.save(blocking=True)
                    finish(ckpt, distributed)
                    return
    finish(ckpt, distributed)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}, args.final)


def finish(ckpt: Checkpointer, distributed: bool) -> None:
    ckpt.close()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
