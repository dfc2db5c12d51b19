"""The plain loop that keeps the best checkpoints by a noisy validation loss, killable at a step.

``python best_loop.py DIR KILL_STEP OUT``: trains a small model for :data:`EPOCHS` epochs of
:data:`BATCHES` batches over a :class:`ResumableLoader`, checkpointing every :data:`EVERY` steps with
``keep=Retention(2, best=("val_loss", "min"), top=2)``; after each epoch's inner loop it evaluates
(a validation loss with noise drawn from the epoch, so that the best is not simply the newest) and
calls ``ckpt.log(val_loss=...)``. Each evaluation is appended to ``OUT.evals`` as a JSON line (step,
val_loss); at ``KILL_STEP`` (0: never) the process SIGKILLs itself right after ``ckpt.step()``. At the
end the model's state at each evaluation is in ``OUT.models/<step>.pt`` and the final state in ``OUT``.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.nn.functional as F
from torch import nn

import checkfreq as cf
from checkfreq.data import ResumableLoader

EPOCHS, BATCHES, BATCH, EVERY = 6, 6, 4, 4
NOISE = [0.0, 0.9, -0.3, 0.6, 0.1, 0.8]
"""Added to each epoch's validation loss: epochs 2 and 4 (0-based: 2, 4, 0) score best, not the newest."""


class Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return BATCHES * BATCH

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, generator=g), i % 3


def main(directory: str, kill_step: int, out: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = ResumableLoader(Points(), batch_size=BATCH, shuffle=True, seed=3)
    val_x = torch.randn(16, 4, generator=torch.Generator().manual_seed(99))
    val_y = torch.arange(16) % 3
    os.makedirs(f"{out}.models", exist_ok=True)
    keep = cf.Retention(2, best=("val_loss", "min"), top=2)
    with cf.Checkpointer(directory, policy=EVERY, keep=keep, model=model, optimizer=opt, loader=loader) as ckpt:
        ckpt.restore()
        for epoch in range(loader.epoch, EPOCHS):
            for x, y in loader:
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                ckpt.step()
                if ckpt.global_step == kill_step:
                    os.kill(os.getpid(), signal.SIGKILL)
            with torch.no_grad():
                val_loss = F.cross_entropy(model(val_x), val_y).item() + NOISE[epoch]
            ckpt.log(val_loss=val_loss)
            torch.save(model.state_dict(), f"{out}.models/{ckpt.global_step}.pt")
            with open(f"{out}.evals", "a") as f:
                f.write(json.dumps({"step": ckpt.global_step, "val_loss": val_loss}) + "\n")
    torch.save(model.state_dict(), out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
