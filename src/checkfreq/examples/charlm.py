"""A real, small training job: a character-level language model on Python's own source code.

The corpus is the source of a fixed list of standard-library modules, so the data ships with
Python and the job runs anywhere without downloads. Used by ``checkfreq demo``; also runnable:

    python -m checkfreq.examples.charlm runs/charlm --steps 600

Each line on stdout is a JSON record (``{"step": ...}`` per step, then ``{"done": ...}``),
which is how the demo watches, kills and compares runs.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

import checkfreq as cf
from checkfreq.data import ResumableLoader

CORPUS_MODULES = ("argparse", "textwrap", "json.decoder", "json.encoder", "csv", "string", "fractions", "heapq")
CONTEXT = 32


def corpus() -> torch.Tensor:
    """UTF-8 bytes of the corpus modules' source, as int64 codes."""
    import importlib

    text = "\n".join(inspect.getsource(importlib.import_module(name)) for name in CORPUS_MODULES)
    return torch.tensor(list(text.encode()), dtype=torch.int64)


class CharWindows(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample ``i``: the ``CONTEXT`` bytes starting at ``i`` and the byte that follows them."""

    def __init__(self, codes: torch.Tensor) -> None:
        self.codes = codes

    def __len__(self) -> int:
        return len(self.codes) - CONTEXT

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codes[i : i + CONTEXT], self.codes[i + CONTEXT]


def make_model(width: int = 1024) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(256, 32),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * CONTEXT, width),
        torch.nn.LayerNorm(width),
        torch.nn.GELU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, 256),
    )


def train(directory: Path | None, steps: int, out: Path, policy: str | int = "auto") -> None:
    """Train for ``steps`` optimizer steps, checkpointing into ``directory`` (None: no checkpoints).

    Resumes from ``directory`` if it holds a checkpoint. Writes the final weights to ``out``.
    """
    torch.set_num_threads(1)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    loader = ResumableLoader(CharWindows(corpus()), batch_size=64, shuffle=True, drop_last=True, seed=0)
    ckpt = None
    step = 0
    if directory is not None:
        ckpt = cf.Checkpointer(
            directory, policy=policy, keep=2, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader
        )
        step = ckpt.restore()
    _emit(resumed_from=step)
    start = time.perf_counter()
    while step < steps:
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            saved = ckpt.step(loss=loss.item()) if ckpt is not None else False
            _emit(step=step, loss=round(loss.item(), 4), checkpoint=saved)
            if step == steps:
                break
    loop_seconds = time.perf_counter() - start
    if ckpt is not None:
        ckpt.close()
    save_file(model.state_dict(), str(out))
    _emit(done=step, loop_seconds=loop_seconds)


def _emit(**record: object) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, nargs="?", help="checkpoint directory (omit: no checkpoints)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", type=Path, default=Path("charlm-final.safetensors"))
    parser.add_argument("--policy", default="auto", help="'auto' or a number of steps")
    args = parser.parse_args(argv)
    policy = int(args.policy) if args.policy.isdigit() else args.policy
    train(args.directory, args.steps, args.out, policy)


if __name__ == "__main__":
    main()
