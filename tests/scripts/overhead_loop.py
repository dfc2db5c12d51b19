"""The overhead tests' training loop and their rule for judging a measured overhead.

Overhead is a ratio of wall times against no-checkpoint runs of the same loop, interleaved and
repeated; the median ratio must stay within the bound plus the measurement's own resolution
here, the spread of the no-checkpoint runs (other jobs on these shared machines move iteration
times by tens of percent; on a quiet machine the margin shrinks to almost nothing).
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from checkfreq.checkpointer import Checkpointer


def setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    """A small MLP (about 6 MB of model and Adam state), its optimizer and one fixed batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt, torch.randn(256, 256), torch.randn(256, 256)


def train(  # type: ignore[no-untyped-def]
    steps: int,
    ckpt: Checkpointer | None,
    model,
    opt,
    x,
    y,
    warmup: int = 0,
    started: list[int] | None = None,
    timed_close: bool = True,
) -> float:
    """Wall seconds for ``steps`` steps after ``warmup`` untimed ones, and closing ``ckpt`` (its wait
    for the last persist) unless ``timed_close`` is false.

    ``started`` collects the steps at which the policy started a checkpoint.
    """
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if ckpt is not None and ckpt.step() and started is not None:
            started.append(ckpt.global_step)
    elapsed = time.perf_counter() - start
    if ckpt is not None:
        ckpt.close()
    return time.perf_counter() - start if timed_close else elapsed


def judge(timed: list[float], before: list[float], after: list[float] | None = None) -> tuple[float, float]:
    """(overhead, noise): the median ratio of paired runs minus one, and the spread of the no-checkpoint runs.

    ``timed[i]`` was measured right after the no-checkpoint run ``before[i]`` and, if given, right
    before ``after[i]``: then it is compared with the mean of the two, which cancels a steady drift
    of the machine's speed. A run is within a bound ``p`` when ``overhead <= p + noise``.
    """
    references = before if after is None else [(b + a) / 2 for b, a in zip(before, after, strict=True)]
    overhead = statistics.median(t / r for t, r in zip(timed, references, strict=True)) - 1
    bases = [*before, *(after or [])]
    noise = (max(bases) - min(bases)) / statistics.median(bases)
    return overhead, noise


@dataclass
class Sessions:
    """Interleaved measurements of sessions resumed from one killed run: see :func:`resumed_sessions`."""

    bases: list[float] = field(default_factory=list)
    resumed: list[float] = field(default_factory=list)
    restored_steps: list[int] = field(default_factory=list)
    resumed_checkpoints: list[list[int]] = field(default_factory=list)
    uninterrupted: list[float] = field(default_factory=list)
    """Wall seconds of a run never killed over the same steps as the resumed session, timed the same way."""
    uninterrupted_checkpoints: list[list[int]] = field(default_factory=list)
    """The checkpoints a run never killed took over the same steps as the resumed session."""
    reasons: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, list]:  # type: ignore[type-arg]
        return dict(self.__dict__)


def resumed_sessions(
    killed: Path,
    workdir: Path,
    reps: int,
    steps: int,
    model,
    opt,
    x,
    y,  # type: ignore[no-untyped-def]
    *,
    forward: torch.nn.Module | None = None,
    leader: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> Sessions:
    """``reps`` times, interleaved: a no-checkpoint run of ``steps`` steps, a session resumed from a
    copy of ``killed`` (a checkpoint directory a SIGKILLed run left) for ``steps`` steps, timed
    whole from its first step to its last (the restore before and the wait for the last persist
    after are one-offs a test-sized session cannot amortise, which a real one of minutes does), and
    an uninterrupted run from step 0 to the end of the resumed one, its last ``steps`` steps timed
    the same way, all under the default policy.

    ``forward`` is the module the loop calls (a DDP wrapper of ``model``); under torch.distributed
    only the ``leader`` copies directories and ``barrier`` waits for it.
    """
    net = forward or model
    out = Sessions()
    train(30, None, net, opt, x, y)  # warm up the allocator, the kernels and the collectives
    for rep in range(reps):
        barrier()
        out.bases.append(train(steps, None, net, opt, x, y))
        copy = workdir / f"resumed-{rep}"
        if leader:
            shutil.copytree(killed, copy)
        barrier()
        ckpt = Checkpointer(copy, keep=2, model=model, optimizer=opt)
        restored = ckpt.restore()
        out.restored_steps.append(restored)
        out.resumed_checkpoints.append([])
        out.resumed.append(train(steps, ckpt, net, opt, x, y, started=out.resumed_checkpoints[-1], timed_close=False))
        out.reasons.append(str(getattr(ckpt.policy, "reason", "")))
        started: list[int] = []
        uninterrupted = Checkpointer(workdir / f"uninterrupted-{rep}", keep=2, model=model, optimizer=opt)
        out.uninterrupted.append(
            train(steps, uninterrupted, net, opt, x, y, warmup=restored, started=started, timed_close=False)
        )
        out.uninterrupted_checkpoints.append([s for s in started if s > restored])
    return out
