"""The epoch loops people write, over a ResumableLoader, each killable at a named point.

Each shape trains the same small model for :data:`EPOCHS` epochs of :data:`BATCHES` batches with
``ckpt.step()`` right after ``optimizer.step()``, and does, after each epoch's inner loop, what such
loops do: an evaluation over a second, unregistered DataLoader (it draws from the global generator),
a best score kept as a value (``ckpt["best"] = ...``) and an epoch-level ``StepLR``. Nothing in a
loop helps checkfreq. A kill point is ``step:N`` (SIGKILL right after ``ckpt.step()`` counted step
N), ``work:E`` (in epoch E's own work, after the evaluation, before the scheduler) or ``none``;
the final state is saved to ``out`` with ``torch.save``.

Under torchrun (``python -m torch.distributed.run ... epoch_loops.py SHAPE DIR POLICY KILL OUT``) the
model is wrapped in DDP over gloo, the loader splits each epoch over the ranks, only rank 1 kills
itself (in the job's first incarnation; torchrun restarts the job) and each rank saves ``OUT.<rank>``.

Shapes:
    ``classic``: ``for epoch in range(loader.epoch, EPOCHS): for x, y in loader: ...``, then
        ``ckpt.save(blocking=True)``.
    ``peek``: the DDP tutorial's epoch: a peek ``next(iter(loader))``, ``set_epoch(epoch)``, then
        ``for i, (x, y) in enumerate(loader)``.
    ``max_steps``: the classic loop that ``break``s out of both loops at :data:`MAX_STEPS` (mid-epoch),
        then saves.
    ``while_true``: ``while True`` over ``iter(loader)``, the epoch's work on ``StopIteration``.
    ``accumulate``: two micro-batches per optimizer step (``ckpt.step()`` after each optimizer step).

A shape named ``SHAPE+after`` does, right after each ``ckpt.step()``, what loops also do there: a
per-step scheduler's ``step()`` (a ``MultiplicativeLR``), a value set (``ckpt["seen"]``) and a
random draw for other work.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import checkfreq as cf
from checkfreq.data import ResumableLoader

EPOCHS, BATCHES, BATCH = 6, 8, 4
MAX_STEPS = 29
SHAPES = ("classic", "peek", "max_steps", "while_true", "accumulate")
SHAPES_AFTER = tuple(f"{shape}+after" for shape in SHAPES)


class Points(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, generator=g), i % 3


class Run:
    """One run of a shape: the objects, the kill point and the epoch's own work."""

    def __init__(self, directory: str, policy: int, kill: str, shape: str) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Linear(16, 3))
        self.net = nn.parallel.DistributedDataParallel(self.model) if dist.is_initialized() else self.model
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=1, gamma=0.7)
        self.per_step = torch.optim.lr_scheduler.MultiplicativeLR(self.opt, lambda _: 0.99)
        self.after = shape.endswith("+after")
        micro = 2 if shape == "accumulate" else 1
        self.micro = micro
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.loader = ResumableLoader(Points(BATCHES * BATCH * micro * world), batch_size=BATCH, shuffle=True, seed=3)
        self.eval_loader = torch.utils.data.DataLoader(Points(12), batch_size=4, shuffle=True)
        killer = not dist.is_initialized() or (dist.get_rank() == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0")
        self.kill = kill if killer else "none"
        self.ckpt = cf.Checkpointer(
            directory,
            policy=policy,
            model=self.model,
            optimizer=self.opt,
            scheduler=self.sched,
            per_step=self.per_step,
            loader=self.loader,
            values={"best": 0.0, "seen": 0},
        )
        self.ckpt.restore()
        self.evaluations: list[int] = []

    def train_on(self, x: torch.Tensor, y: torch.Tensor, *, step: bool = True) -> None:
        loss = F.cross_entropy(self.net(x), y) / self.micro
        loss.backward()
        if step:
            self.opt.step()
            self.opt.zero_grad()
            self.ckpt.step(loss=loss.item())
            if self.kill == f"step:{self.ckpt.global_step}":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.after:  # the step's own work, after ckpt.step()
                self.per_step.step()
                self.ckpt["seen"] += 1
                torch.rand(1)

    def epoch_work(self, epoch: int) -> None:
        self.model.eval()
        with torch.no_grad():
            score = sum(float(self.model(x).softmax(1)[:, 0].sum()) for x, _ in self.eval_loader)
        self.model.train()
        self.ckpt["best"] = max(self.ckpt["best"], score)
        self.evaluations.append(epoch)
        if self.kill == f"work:{epoch}":
            os.kill(os.getpid(), signal.SIGKILL)
        self.sched.step()

    def save(self, out: str) -> None:
        self.ckpt.save(blocking=True)
        self.ckpt.close()
        torch.save(
            {
                "model": self.model.state_dict(),
                "optimizer": self.opt.state_dict(),
                "lr": self.opt.param_groups[0]["lr"],
                "rng": torch.get_rng_state(),
                "best": self.ckpt["best"],
                "seen": self.ckpt["seen"],
                "step": self.ckpt.global_step,
                "epoch": self.loader.epoch,
                "evaluations": self.evaluations,
            },
            out,
        )


def train(shape: str, directory: str, policy: int, kill: str, out: str) -> None:
    run = Run(directory, policy, kill, shape)
    loader = run.loader
    shape = shape.removesuffix("+after")
    if shape in ("classic", "max_steps"):
        for epoch in range(loader.epoch, EPOCHS):
            for x, y in loader:
                run.train_on(x, y)
                if shape == "max_steps" and run.ckpt.global_step >= MAX_STEPS:
                    break
            if shape == "max_steps" and run.ckpt.global_step >= MAX_STEPS:
                break
            run.epoch_work(epoch)
    elif shape == "peek":
        for epoch in range(loader.epoch, EPOCHS):
            assert len(next(iter(loader))[0]) == BATCH
            loader.set_epoch(epoch)
            for _, (x, y) in enumerate(loader):
                run.train_on(x, y)
            run.epoch_work(epoch)
    elif shape == "while_true":
        batches = iter(loader)
        while loader.epoch < EPOCHS:
            try:
                x, y = next(batches)
            except StopIteration:
                run.epoch_work(loader.epoch - 1)
                batches = iter(loader)
                continue
            run.train_on(x, y)
    elif shape == "accumulate":
        for epoch in range(loader.epoch, EPOCHS):
            for i, (x, y) in enumerate(loader):
                run.train_on(x, y, step=i % 2 == 1)
            run.epoch_work(epoch)
    else:
        raise ValueError(shape)
    run.save(out)


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        out = f"{sys.argv[5]}.{dist.get_rank()}"
        train(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], out)
        dist.destroy_process_group()
    else:
        train(*sys.argv[1:3], int(sys.argv[3]), *sys.argv[4:6])
