"""Two loops users write, integrated as the README shows and nothing more, each killable at a named point.

``mnist``: the loop of pytorch/examples ``mnist/main.py`` (a small convolutional net with two
dropouts, Adadelta, ``StepLR(step_size=1, gamma=0.7)``; per epoch ``train()``, then ``test()`` under
``torch.no_grad()``, then ``scheduler.step()``) on synthetic images, with keep-best as the README
shows it: ``keep=Retention(3, best=("test_loss", "min"), top=1)`` and ``ckpt.log(test_loss=...)``
right after ``test()``, before the example's own ``scheduler.step()``.

``nanogpt``: nanoGPT's loop shape: the learning rate set by hand at the top of each iteration, an
evaluation every few steps in ``model.eval()`` *without* ``torch.no_grad()`` drawing its batches from
the global generator, two micro-steps whose next batch is fetched from a registered
``ResumableLoader`` right after the forward (before ``backward()`` and the optimizer step), gradient
clipping, a model with dropout and BatchNorm.

Kill points: ``step:N`` (SIGKILL right after ``ckpt.step()`` counted step N), ``test:E`` (during
epoch E's ``test()``), ``sched:E`` (right after epoch E's ``scheduler.step()``), ``eval:N`` (during
the evaluation at the top of the iteration after step N), ``none``. The final state goes to ``out``.
"""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import checkfreq as cf
from checkfreq.data import ResumableLoader

EPOCHS, BATCHES, BATCH = 3, 10, 8
NANO_STEPS, NANO_EVAL = 24, 5


class Images(torch.utils.data.Dataset):
    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.offset + i)
        return torch.randn(1, 12, 12, generator=g), (self.offset + i) % 10


class Net(nn.Module):
    """mnist/main.py's Net, on 12 x 12 images."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 4, 3, 1), nn.Conv2d(4, 8, 3, 1)
        self.dropout1, self.dropout2 = nn.Dropout(0.25), nn.Dropout(0.5)
        self.fc1, self.fc2 = nn.Linear(8 * 4 * 4, 16), nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.dropout2(F.relu(self.fc1(torch.flatten(self.dropout1(x), 1))))
        return F.log_softmax(self.fc2(x), dim=1)


def _kill_if(kill: str, point: str) -> None:
    if kill == point:
        os.kill(os.getpid(), signal.SIGKILL)


def _seed() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


def _ended(model: nn.Module, opt: torch.optim.Optimizer, ckpt: cf.Checkpointer, **more: object) -> dict:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "lr": opt.param_groups[0]["lr"],
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state()[1].copy(),
        "python": random.getstate(),
        "step": ckpt.global_step,
        **more,
    }


def mnist(directory: str, policy: int, kill: str, out: str) -> None:
    _seed()
    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    train_loader = ResumableLoader(Images(BATCHES * BATCH), batch_size=BATCH, shuffle=True, seed=1)
    test_loader = torch.utils.data.DataLoader(Images(16, offset=1000), batch_size=8)
    keep = cf.Retention(3, best=("test_loss", "min"), top=1)
    after_epoch: dict[int, dict] = {}
    with cf.Checkpointer(
        directory, policy=policy, keep=keep, model=model, optimizer=optimizer, scheduler=scheduler, loader=train_loader
    ) as ckpt:
        ckpt.restore()
        for epoch in range(train_loader.epoch + 1, EPOCHS + 1):
            model.train()
            for data, target in train_loader:
                optimizer.zero_grad()
                loss = F.nll_loss(model(data), target)
                loss.backward()
                optimizer.step()
                ckpt.step()
                _kill_if(kill, f"step:{ckpt.global_step}")
            model.eval()
            test_loss = 0.0
            with torch.no_grad():
                for data, target in test_loader:
                    test_loss += F.nll_loss(model(data), target, reduction="sum").item()
                    _kill_if(kill, f"test:{epoch}")
            test_loss /= len(test_loader.dataset)
            ckpt.log(test_loss=test_loss)
            scheduler.step()
            _kill_if(kill, f"sched:{epoch}")
            after_epoch[ckpt.global_step] = _ended(model, optimizer, ckpt, test_loss=test_loss)
        ckpt.save(blocking=True)
    torch.save({**_ended(model, optimizer, ckpt), "after_epoch": after_epoch}, out)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.norm = nn.Embedding(32, 16), nn.BatchNorm1d(16)
        self.drop, self.head = nn.Dropout(0.2), nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).mean(1)
        return self.head(self.drop(self.norm(h)))


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        x = torch.randint(0, 32, (6,), generator=g)
        return x, int(x.sum()) % 32


def nanogpt(directory: str, policy: int, kill: str, out: str) -> None:
    _seed()
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = ResumableLoader(Tokens(), batch_size=4, shuffle=True, seed=2)
    eval_data = torch.randint(0, 32, (64, 6), generator=torch.Generator().manual_seed(9))
    with cf.Checkpointer(directory, policy=policy, model=model, optimizer=optimizer, loader=loader) as ckpt:
        ckpt.restore()
        batches = iter(loader)

        def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
            nonlocal batches
            try:
                return next(batches)
            except StopIteration:
                batches = iter(loader)
                return next(batches)

        x, y = next_batch()
        losses = []
        while ckpt.global_step < NANO_STEPS:
            for group in optimizer.param_groups:
                group["lr"] = 1e-2 * min(1.0, (ckpt.global_step + 1) / 8)  # get_lr(iter_num), set by hand
            if ckpt.global_step % NANO_EVAL == 0:
                model.eval()  # no torch.no_grad(): an evaluation all the same
                ix = torch.randint(0, len(eval_data), (8,))  # drawn from the global generator
                losses.append(float(F.cross_entropy(model(eval_data[ix]), eval_data[ix, 0])))
                _kill_if(kill, f"eval:{ckpt.global_step}")
                model.train()
            for _ in range(2):
                loss = F.cross_entropy(model(x), y) / 2
                x, y = next_batch()  # prefetched while the step runs, before backward() and the optimizer step
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ckpt.step()
            _kill_if(kill, f"step:{ckpt.global_step}")
        ckpt.save(blocking=True)
    torch.save(_ended(model, optimizer, ckpt), out)


LOOPS = {"mnist": mnist, "nanogpt": nanogpt}


def train(loop: str, directory: str, policy: int, kill: str, out: str) -> None:
    LOOPS[loop](directory, policy, kill, out)
