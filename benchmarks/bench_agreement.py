"""What the per-step decision agreement costs under DDP (issue 15's open question).

Usage: ``python benchmarks/bench_agreement.py [--nproc 2] [--steps 300] [--pairs 4]``

Runs itself under ``torchrun`` (CPU, gloo, one torch thread per rank). Every rank trains the
overhead loop's MLP with DDP and, in pairs of runs, compares the wall time of ``--steps`` steps:

* without a Checkpointer (the base, measured right before each variant);
* ``agreed``: a Checkpointer whose policy never saves but, not counting steps, has its answer
  agreed by every rank at each ``step()`` (a non-blocking MAX all-reduce on the control group);
* ``step count``: a Checkpointer with ``Every(n)`` for a huge ``n``, which needs no messages.

No checkpoint is taken: the difference is what the decision exchange costs. Prints each pair's
overhead and the median per variant.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from checkfreq import Checkpointer, DecisionContext, Every, Policy


class Never(Policy):
    """Never checkpoints; any policy but a step count is agreed between ranks at every step."""

    def should_save(self, ctx: DecisionContext) -> bool:
        return False


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), torch.randn(256, 256), torch.randn(256, 256)


def _worker(steps: int, pairs: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, opt, x, y = _model()
    net = torch.nn.parallel.DistributedDataParallel(model)
    root = [tempfile.mkdtemp(prefix="cf-agree-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root)

    def run(ckpt: Checkpointer | None) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if ckpt is not None:
                ckpt.step()
        return time.perf_counter() - start

    overheads: dict[str, list[float]] = {"agreed": [], "step count": []}
    for pair in range(pairs):
        for name, policy in (("agreed", Never()), ("step count", Every(10**9))):
            base = run(None)
            ckpt = Checkpointer(Path(root[0]) / f"{name.replace(' ', '-')}-{pair}", policy=policy, model=model, optimizer=opt)
            timed = run(ckpt)
            ckpt.close()
            overheads[name].append(timed / base - 1)
    if dist.get_rank() == 0:
        for name, values in overheads.items():
            pairs_text = ", ".join(f"{v:+.1%}" for v in values)
            print(f"{name:>10}: median {statistics.median(values):+.1%} (pairs: {pairs_text})")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.steps, args.pairs)
        return
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               __file__, "--worker", "--steps", str(args.steps), "--pairs", str(args.pairs)]
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    main()
