"""What agreeing on when to checkpoint costs under DDP, against agreeing at every step.

Usage: ``python benchmarks/bench_agreement.py [--nproc 2] [--steps 300] [--pairs 4] [--policy never|auto]``

Runs itself under ``torchrun`` (CPU, gloo, one torch thread per rank). Every rank trains the
overhead loop's MLP with DDP and, in pairs of runs, compares the wall time of ``--steps`` steps:

* without a Checkpointer (the base, measured right before each variant);
* ``agreed``: a Checkpointer whose policy never saves but, not counting steps, has its answer
  agreed by the ranks (a vote up and down a tree of the ranks, on each rank's vote thread, about
  every ``checkfreq.ranks.agreement.VOTE_SECONDS`` of training);
* ``every step``: the same, agreed at every ``step()`` (``VOTE_SECONDS = 0``);
* ``step count``: a Checkpointer with ``Every(n)`` for a huge ``n``, which needs no messages.

No checkpoint is taken: the difference is what the decision exchange costs. With ``--policy auto``
the variants run the default policy instead (``agreed``, ``every step``; the step count does not
apply) and checkpoint: the difference is the whole-run overhead the bound promises. Prints each
pair's overhead, the median per variant and, for ``auto``, the checkpoints taken.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from checkfreq import Auto, Checkpointer, DecisionContext, Every, Policy
from checkfreq.ranks import agreement


class Never(Policy):
    """Never checkpoints; any policy but a step count is agreed between ranks at every step."""

    def should_save(self, ctx: DecisionContext) -> bool:
        return False


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), torch.randn(256, 256), torch.randn(256, 256)


def _variants(policy: str) -> dict[str, Callable[[], Policy]]:
    if policy == "auto":
        return {"agreed": Auto, "every step": Auto}
    return {"agreed": Never, "every step": Never, "step count": lambda: Every(10**9)}


def _worker(steps: int, pairs: int, policy: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, opt, x, y = _model()
    net = torch.nn.parallel.DistributedDataParallel(model)
    root = [tempfile.mkdtemp(prefix="cf-agree-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root)

    def run(ckpt: Checkpointer | None) -> tuple[float, int]:
        """Seconds for ``steps`` steps (with the last checkpoint durable), and checkpoints started."""
        dist.barrier()
        start, taken = time.perf_counter(), 0
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if ckpt is not None:
                taken += ckpt.step()
        if ckpt is not None:
            ckpt.wait()
        return time.perf_counter() - start, taken

    variants = _variants(policy)
    overheads: dict[str, list[float]] = {name: [] for name in variants}
    checkpoints: dict[str, list[int]] = {name: [] for name in variants}
    default_period = agreement.VOTE_SECONDS
    for pair in range(pairs):
        for name, make in variants.items():
            agreement.VOTE_SECONDS = 0.0 if name == "every step" else default_period
            base, _ = run(None)
            directory = Path(root[0]) / f"{name.replace(' ', '-')}-{pair}"
            ckpt = Checkpointer(directory, policy=make(), keep=1, model=model, optimizer=opt)
            timed, taken = run(ckpt)
            ckpt.close()
            overheads[name].append(timed / base - 1)
            checkpoints[name].append(taken)
    if dist.get_rank() == 0:
        for name, values in overheads.items():
            pairs_text = ", ".join(f"{v:+.1%}" for v in values)
            taken_text = f"; checkpoints {checkpoints[name]}" if policy == "auto" else ""
            print(f"{name:>10}: median {statistics.median(values):+.1%} (pairs: {pairs_text}){taken_text}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--policy", choices=("never", "auto"), default="never")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.steps, args.pairs, args.policy)
        return
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        __file__,
        "--worker",
        "--steps",
        str(args.steps),
        "--pairs",
        str(args.pairs),
        "--policy",
        args.policy,
    ]
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    main()
