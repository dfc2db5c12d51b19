"""A data-parallel run with a fixed global batch, for the resize tests (tests/distributed/test_elastic.py).

Runs under ``torchrun`` (DDP over gloo, any number of ranks) or as one plain process. Restores
from ``--ckpt-dir`` if a checkpoint is there and trains to the end: a ``ResumableLoader`` with
``--global-batch`` samples per optimizer step (each rank's slice cut into micro-batches of at most
``--micro`` samples, their gradients accumulated), an MLP, AdamW and an LR schedule. The model has
neither BatchNorm nor dropout: both depend on how a global batch is split over the ranks, so a
resized run could not follow the uninterrupted one.

Each rank appends one line per optimizer step to ``--step-log``:
``life step rank world accumulation loss fingerprint index index ...``, ``loss`` being the mean
loss of the whole global batch (summed over the ranks), ``fingerprint`` the sum of the parameters
after the step (in float64) and the indices this rank's samples of the step. At the end rank 0
writes the model, optimizer and scheduler state to ``--final``.

* ``--die LIFE:STEP``: in incarnation LIFE (torchrun's ``TORCHELASTIC_RESTART_COUNT``), rank 0
  waits for the checkpoint in flight, then SIGKILLs itself after optimizer step STEP.
* ``--kill-node STEP``: in the first incarnation, after step STEP, every rank waits for the newest
  checkpoint to be in the remote tier, then the last rank SIGKILLs its torchrun agent and itself:
  its node is gone for good.
* ``--pause-at WORLD:STEP``: at world size WORLD, after step STEP, rank 0 waits for the newest
  checkpoint to be in the remote tier, creates ``<step-log>.paused`` and sleeps (up to 120 s): a
  node that joins an elastic job now makes torchrun restart the workers at the larger size.
* ``--stop-at STEP``: take a blocking checkpoint at step STEP and exit cleanly.
* ``--batch-size N``: instead of a global batch, ``N`` samples per rank and step (the batch then
  grows and shrinks with the world size: the contrast in docs/distributed.md's figure).
* ``--remote PATH``: a shared remote tier; ``--ckpt-dir`` is then the node's local directory.
* ``--memory N``: the memory tier, a snapshot every N steps.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from noisy_points import NoisyPoints  # beside this script
from torch import nn
from worker_exit import exit_without_teardown  # beside this script

from checkfreq import Checkpointer
from checkfreq.data import ResumableLoader

StepLog = dict[int, dict[int, tuple[float, list[int], int]]]
"""Step -> rank -> (loss of the global batch, the rank's sample ids, world size)."""


def command(nproc: int, *args: str) -> list[str]:
    """This script on ``nproc`` ranks under torchrun, one attempt (``nproc`` 0: one plain process)."""
    script = [str(Path(__file__)), *args]
    if not nproc:
        return [sys.executable, *script]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "--monitor-interval=0.1",
        *script,
    ]


def read_steps(*logs: Path) -> StepLog:
    """The steps the ``--step-log`` files record, read in order; a step logged again (a rank logs it a
    second time, or at another world size) is a replay after a restart and replaces the earlier one."""
    steps: StepLog = {}
    for log in logs:
        for line in log.read_text().splitlines():
            _, step, rank, world, _, loss, _, *ids = line.split()
            entry = steps.setdefault(int(step), {})
            if int(rank) in entry or any(w != int(world) for _, _, w in entry.values()):
                entry.clear()
            entry[int(rank)] = (float(loss), [int(i) for i in ids], int(world))
    return steps


def step_samples(steps: StepLog) -> dict[int, list[int]]:
    """Step -> the sorted sample ids of its global batch, over all ranks."""
    return {step: sorted(i for _, ids, _ in ranks.values() for i in ids) for step, ranks in steps.items()}


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--final", required=True)
    parser.add_argument("--step-log", required=True)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--die", default="", help="LIFE:STEP")
    parser.add_argument("--kill-node", type=int, default=None)
    parser.add_argument("--pause-at", default="", help="WORLD:STEP")
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--remote", default=None)
    parser.add_argument("--memory", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    batches = (
        {"batch_size": args.batch_size}
        if args.batch_size
        else {"global_batch_size": args.global_batch, "micro_batch_size": args.micro}
    )
    loader = ResumableLoader(NoisyPoints(args.samples), shuffle=True, seed=5, **batches)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 3))
    net = nn.parallel.DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
    ckpt = Checkpointer(
        args.ckpt_dir,
        policy=args.every,
        keep=2,
        remote=args.remote,
        memory=args.memory or False,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
    )
    step = ckpt.restore()
    accumulation = loader.accumulation_steps
    # one write, newline included: the ranks share the agent's stdout, and print() writes its end apart
    print(
        f"life={life} rank={rank} world={world} restored step={step} accumulation={accumulation} "
        f"batch={loader.batch_size}\n",
        end="",
        flush=True,
    )

    with open(args.step_log, "a") as log:
        for _ in range(loader.epoch, args.epochs):
            for number, (x, y, index) in enumerate(loader):
                last = (number + 1) % accumulation == 0
                with nullcontext() if last or not distributed else net.no_sync():
                    losses = nn.functional.cross_entropy(net(x), y, reduction="none")
                    (losses.mean() / accumulation).backward()  # DDP averages over ranks: the global mean
                if number % accumulation == 0:
                    step_loss, step_indices = torch.zeros(()), []
                step_loss += losses.detach().sum()
                step_indices += index.tolist()
                if not last:
                    continue
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                ckpt.step()
                if distributed:
                    dist.all_reduce(step_loss)
                fingerprint = sum(p.detach().double().sum() for p in model.parameters()).item()
                log.write(
                    f"{life} {ckpt.global_step} {rank} {world} {accumulation} "
                    f"{step_loss.item() / loader.global_batch_size!r} {fingerprint!r} "
                    f"{' '.join(map(str, step_indices))}\n"
                )
                log.flush()
                if args.die == f"{life}:{ckpt.global_step}" and rank == 0:
                    ckpt.wait()
                    os.kill(os.getpid(), signal.SIGKILL)
                if ckpt.global_step == args.kill_node and life == 0:
                    ckpt.wait(remote=True)  # collective: every rank
                    if rank == world - 1:
                        os.kill(os.getppid(), signal.SIGKILL)  # the torchrun agent that started this worker
                        os.kill(os.getpid(), signal.SIGKILL)
                if args.pause_at == f"{world}:{ckpt.global_step}" and rank == 0:
                    ckpt.wait(remote=True)
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun's restart ends the pause at once
                    Path(f"{args.step_log}.paused").touch()
                    time.sleep(120)
                if ckpt.global_step == args.stop_at:
                    ckpt.save(blocking=True)
                    finish(ckpt, distributed)
                    return
    if rank == 0:  # before the ranks part: torch may abort a rank as it exits (below), and its agent stop this one
        torch.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
            args.final,
        )
    finish(ckpt, distributed)


def finish(ckpt: Checkpointer, distributed: bool) -> None:
    """Close the Checkpointer; under torchrun, destroy the group."""
    ckpt.close()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
