"""A 2-epoch custom training loop under ``accelerate launch``, checkpointed by checkfreq.

The loop of docs/huggingface.md ("Accelerate loops"): model, optimizer and scheduler prepared by
Accelerate, a ResumableLoader built after the Accelerator (so it takes this rank's share), a
checkpoint every ``--every`` optimizer steps. With ``--die-at K`` rank ``--die-rank`` SIGKILLs
itself after optimizer step K, once the checkpoint in flight is durable. Each rank appends its
batches to ``--batch-log`` + ``.RANK`` as ``epoch consumed index ...``; rank 0 writes ``--out``.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
from accelerate import Accelerator
from noisy_points import NoisyPoints  # beside this script
from torch import nn
from worker_exit import exit_without_teardown  # beside this script

from checkfreq import Checkpointer
from checkfreq.data import ResumableLoader


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch-log", required=True)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--die-rank", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    loader = ResumableLoader(NoisyPoints(64), batch_size=4, shuffle=True, seed=5)
    ckpt = Checkpointer(
        args.dir,
        policy=args.every,
        keep=2,
        model=accelerator.unwrap_model(model),
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
    )
    restored = ckpt.restore()

    rank = accelerator.process_index
    with open(f"{args.batch_log}.{rank}", "a") as log:
        for epoch in range(loader.epoch, 2):
            for x, y, index in loader:
                log.write(f"{epoch} {loader.state_dict()['consumed']} {' '.join(map(str, index.tolist()))}\n")
                log.flush()
                loss = nn.functional.cross_entropy(model(x.to(accelerator.device)), y.to(accelerator.device))
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                ckpt.step()
                if ckpt.global_step == args.die_at and rank == args.die_rank:
                    ckpt.wait()
                    os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    print(f"rank {rank} restored {restored} final {ckpt.global_step}", flush=True)
    if rank == 0:
        torch.save(
            {
                "model": accelerator.unwrap_model(model).state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
            },
            args.out,
        )
    accelerator.end_training()


if __name__ == "__main__":
    main()
    exit_without_teardown()
