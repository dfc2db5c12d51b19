"""A small but complete training run for the exact-resume acceptance test.

Restores from ``--dir`` if a checkpoint is there, trains to the end (shuffled resumable loader,
random augmentation, dropout, gradient accumulation, AdamW and an LR schedule) and writes the
final state to ``--out``. With ``--die-at K`` it SIGKILLs itself while loading the batch after
optimizer step ``K`` (after the checkpoint in flight is durable unless ``--no-wait``: one due at
an epoch's last step is taken at the epoch boundary, as that batch's pass begins).

``--serve`` starts a zygote instead: it imports torch once (seconds) and runs each request read
from stdin (a JSON line: ``argv`` and ``output``, a file for the run's stdout and stderr) in a
freshly forked child in its own session, answering with a JSON line holding the exit code.

Every batch is appended to ``--log`` as ``epoch consumed index index ...``: ``consumed`` (the
loader's position after the batch) names the batch within its epoch, so a batch replayed after a
restore overwrites its earlier line when the test reads the log.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import os
import random
import signal
import sys
import threading
import traceback

import numpy as np
import torch
from noisy_points import NoisyPoints  # beside this script
from torch import nn

from checkfreq.checkpointer import Checkpointer
from checkfreq.data import ResumableLoader

ACCUMULATION = 2
PR_SET_CHILD_SUBREAPER = 36  # Linux prctl option


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--drop-last", action="store_true")
    parser.add_argument("--samples", type=int, default=70)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every", type=int, default=2, help="checkpoint every n optimizer steps")
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--no-wait", action="store_true")
    return parser.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer, object, ResumableLoader]:
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.8)
    loader = ResumableLoader(
        NoisyPoints(args.samples),
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=args.drop_last,
        num_workers=args.num_workers,
        seed=5,
    )
    return model, optimizer, scheduler, loader


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(60, exit=True)  # a hang fails the run, with its stacks
    model, optimizer, scheduler, loader = build(args)
    ckpt = Checkpointer(
        args.dir,
        policy=args.every,
        keep=2,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
    )
    step = ckpt.restore()
    state = loader.state_dict()
    print(f"restored step={step} epoch={state['epoch']} consumed={state['consumed']}", flush=True)

    def optimizer_step() -> bool:
        """One optimizer step; True when the run is to die at the next batch."""
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        ckpt.step()
        return ckpt.global_step == args.die_at

    dying = False
    with open(args.log, "a") as log:
        for epoch in range(loader.epoch, args.epochs):
            pending = 0  # a checkpoint is only ever taken at an optimizer-step boundary
            for x, y, index in loader:
                if dying:  # the batch after step K: a checkpoint due at an epoch's end was taken as it began
                    if not args.no_wait:
                        ckpt.wait()
                    os.kill(os.getpid(), signal.SIGKILL)
                log.write(f"{epoch} {loader.state_dict()['consumed']} {' '.join(map(str, index.tolist()))}\n")
                log.flush()
                loss = nn.functional.cross_entropy(model(x), y) / ACCUMULATION
                loss.backward()
                pending += 1
                if pending == ACCUMULATION:
                    dying = optimizer_step()
                    pending = 0
            if pending:
                dying = optimizer_step()
    ckpt.close()
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
        },
        args.out,
    )


def serve() -> None:
    """Zygote: run each request from stdin in a forked child, answer with its exit code."""
    build(parse(["--dir", "", "--out", "", "--log", ""]))  # imports what a run needs, once
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    if threading.active_count() != 1:
        raise RuntimeError("the zygote must not fork with threads running")
    for line in sys.stdin:
        request = json.loads(line)
        print(json.dumps({"exitcode": run_forked(request["argv"], request["output"])}), flush=True)


def run_forked(argv: list[str], output: str) -> int:
    """Run ``main(argv)`` in a child; return once it and every process it left behind are gone."""
    pid = os.fork()
    if pid == 0:
        child(argv, output)
    _, status = os.waitpid(pid, 0)
    try:
        os.killpg(pid, signal.SIGKILL)  # DataLoader workers orphaned by a killed run
    except ProcessLookupError:
        pass
    while True:  # as subreaper, the zygote inherits the orphans: reap them all
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return os.waitstatus_to_exitcode(status)


def child(argv: list[str], output: str) -> None:
    """Run ``main(argv)`` in this forked process, its own session, printing to ``output``; never returns."""
    os.setsid()
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 1
    try:
        main(argv)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    serve() if sys.argv[1:] == ["--serve"] else main()
