"""The training thread's cost of a checkpoint as the state is split into more tensors, beside a plain copy loop.

    python -m benchmarks.tensor_count [--counts 40 900 4000 16000] [--rounds 7] [--json out.json]

A state of about 23 MB (``--megabytes``) is split into ``count`` tensors: ``count / 4`` bias-free
``Linear`` layers under AdamW, four tensors a layer (the weight, ``exp_avg``, ``exp_avg_sq``, ``step``).
For each count and each mode, rounds interleave:

* **checkpoint**: ``ckpt.step()`` at a step the policy checkpoints, then the consistent point
  (``ckpt.consistent_point()``), timed on the training thread; the persist then runs out of the timing;
* **copy loop**: ``dst.copy_(src)`` over the same tensors into tensors allocated once;
* **between**: ``ckpt.step()`` at a step with nothing to take.

Modes: ``disk`` (``policy=cf.Every(2)``, no memory tier) and ``memory`` (``memory=1``: a memory
snapshot at every step, nothing on disk). It prints, per count and mode, the medians over the rounds,
the ratio of a checkpoint to the copy loop (median of the rounds' ratios, and their min-max), and the
between-checkpoints cost, every figure from the same run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

import checkfreq as cf
from benchmarks.report import print_rows

MODES = ("disk", "memory")


@dataclass
class Row:
    """One count and mode: medians over the rounds, in seconds, and the checkpoint-to-copy ratios."""

    count: int
    mode: str
    checkpoint_s: float
    copy_loop_s: float
    between_s: float
    ratio: float
    ratio_min: float
    ratio_max: float


def _state(count: int, megabytes: float) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
    """A model of ``count / 4`` layers holding about ``megabytes`` MB with AdamW's state, and its tensors."""
    layers = max(1, count // 4)
    width = max(1, int((megabytes * 1e6 / 4 / 3 / layers) ** 0.5))
    torch.manual_seed(0)
    model = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    for parameter in model.parameters():
        parameter.grad = torch.full_like(parameter, 1e-3)
    optimizer.step()  # AdamW's state exists from here on
    tensors = [*model.parameters(), *(t for state in optimizer.state.values() for t in state.values())]
    return model, optimizer, tensors


@contextmanager
def _checkpointer(mode: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[cf.Checkpointer]:
    with tempfile.TemporaryDirectory() as directory:
        if mode == "disk":
            ckpt = cf.Checkpointer(directory, model=model, optimizer=optimizer, policy=cf.Every(2))
        else:
            ckpt = cf.Checkpointer(directory, model=model, optimizer=optimizer, policy=cf.Every(10**9), memory=1)
        with ckpt:
            yield ckpt


def _timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def measure(count: int, mode: str, rounds: int, megabytes: float) -> Row:
    """One count and mode, ``rounds`` interleaved rounds after two warm-up ones."""
    model, optimizer, tensors = _state(count, megabytes)
    copies = [t.clone() for t in tensors]

    def copy_loop() -> None:
        with torch.no_grad():
            for dst, src in zip(copies, tensors, strict=True):
                dst.copy_(src)

    def checkpoint() -> None:
        ckpt.step()
        ckpt.consistent_point()

    taken, copied, between = [], [], []
    with _checkpointer(mode, model, optimizer) as ckpt:
        for round_ in range(rounds + 2):
            optimizer.step()
            if mode == "disk":  # Every(2): this step has nothing to take, the next one checkpoints
                between_s = _timed(ckpt.step)
                ckpt.consistent_point()
                optimizer.step()
            checkpoint_s = _timed(checkpoint)
            ckpt.wait()  # the persist (or the memory commit) out of the next round's timing
            copy_s = _timed(copy_loop)
            if mode == "memory":
                between_s = float("nan")  # every step takes a snapshot
            if round_ >= 2:
                taken.append(checkpoint_s)
                copied.append(copy_s)
                between.append(between_s)
    ratios = [t / c for t, c in zip(taken, copied, strict=True)]
    return Row(
        count=len(tensors),
        mode=mode,
        checkpoint_s=statistics.median(taken),
        copy_loop_s=statistics.median(copied),
        between_s=statistics.median(between),
        ratio=statistics.median(ratios),
        ratio_min=min(ratios),
        ratio_max=max(ratios),
    )


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| tensors | mode | copy loop | checkpoint (training thread) | ratio (min-max) | step() between |",
        "| ---: | --- | ---: | ---: | --- | ---: |",
    ]
    for r in rows:
        between = "—" if r.between_s != r.between_s else f"{r.between_s * 1e6:.0f} µs"
        lines.append(
            f"| {r.count:,} | {r.mode} | {r.copy_loop_s * 1e3:.1f} ms | {r.checkpoint_s * 1e3:.1f} ms | "
            f"{r.ratio:.2f}× ({r.ratio_min:.2f}-{r.ratio_max:.2f}) | {between} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[40, 900, 4000, 16000])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--megabytes", type=float, default=23.0)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = [measure(count, mode, args.rounds, args.megabytes) for count in args.counts for mode in args.modes]
    print_rows(table(rows), rows, args.json)


if __name__ == "__main__":
    main()
