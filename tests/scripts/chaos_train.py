"""The training job of the fault-injection campaign (``benchmarks/chaos.py``) and the preemption tests.

A small but complete run: shuffled :class:`~checkfreq.data.ResumableLoader` over noisy
samples, BatchNorm and dropout, AdamW, an LR schedule, a checkpoint every ``--every`` steps.
It restores whatever the directory holds, trains to the end, and prints one line per event on
``--progress-fd`` (default stdout)::

    ready <restored step>      after restore()
    step <n>                   after each ckpt.step() returned
    chaos <phase> <n>          a test hook reached its phase (then sleeps until killed)
    final <sha256>             digest of the complete final state (weights, optimizer, RNG, data position)

Test hooks (``--hook PHASE --hook-at N``) stop the N-th occurrence of a phase so that a SIGKILL
from outside lands exactly there. They wrap functions of this process only, from here; the
library carries no test code. Phases: ``snapshot`` (phase 1 copy starting), ``copy`` (the
deferred copy in the writer), ``write`` (a file of a staging directory half written),
``fsync``, ``rename`` (before or after, alternating), ``retention`` (a hidden old checkpoint
half deleted), ``header`` (with ``--memory``: a memory snapshot copied, its slot header not yet
written). With ``--memory``, ``snapshot`` and ``copy`` also stop memory snapshots mid-copy.
A test's own stop, not drawn by the campaign: ``slot`` (with ``--memory``: a snapshot about to
open its slot, once both slots hold a committed snapshot and no commit is in flight).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

import checkfreq as cf
from checkfreq.data import ResumableLoader
from checkfreq.pipeline.capture.snapshot import PendingSnapshot, Snapshotter
from checkfreq.storage.shm import MemoryRegion

HOOK_SLEEP_S = 60.0
PHASES = ("snapshot", "copy", "write", "fsync", "rename", "retention")
MEMORY_PHASES = ("header",)
QUIET_PHASES = ("slot",)


class NoisySamples:
    """Fixed points and labels; each fetch adds fresh noise from the global torch RNG."""

    def __init__(self, length: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(length, 16, generator=generator)
        self.y = torch.randint(0, 4, (length,), generator=generator)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index] + 0.1 * torch.randn(16), self.y[index]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--memory", type=int, default=0, help="memory-tier cadence in steps (0: off)")
    parser.add_argument("--hook", choices=PHASES + MEMORY_PHASES + QUIET_PHASES)
    parser.add_argument("--hook-at", type=int, default=1)
    parser.add_argument("--save-on-signal", type=int, action="append", default=[], help="signal number")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra 'compute' per step")
    parser.add_argument("--progress-fd", type=int, default=1)
    return parser.parse_args(argv)


class Progress:
    """Unbuffered, one write per line: what was written survives a SIGKILL."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._write = os.write  # progress lines; the write hook wraps os.pwrite

    def __call__(self, *words: object) -> None:
        self._write(self.fd, (" ".join(map(str, words)) + "\n").encode())


def install_hook(phase: str, at: int, progress: Progress, root: str) -> None:
    """Stop the ``at``-th occurrence of ``phase`` in this process (announce, then sleep)."""
    seen = 0
    root = os.path.realpath(root)

    def reached() -> bool:
        nonlocal seen
        seen += 1
        if seen != at:
            return False
        progress("chaos", phase, seen)
        time.sleep(HOOK_SLEEP_S)
        return True

    def ours(path: Any) -> bool:
        return os.path.realpath(path).startswith(root)

    if phase == "snapshot":
        Snapshotter.take = _before(Snapshotter.take, lambda *_, **__: reached())  # type: ignore[method-assign]
    elif phase == "copy":
        PendingSnapshot.finish_copy = _before(PendingSnapshot.finish_copy, lambda _: reached())  # type: ignore[method-assign]
    elif phase == "write":
        os.pwrite = _after(os.pwrite, lambda fd, *_: ".tmp-" in _fd_path(fd) and reached())
    elif phase == "fsync":
        os.fsync = _before(os.fsync, lambda fd: ours(_fd_path(fd)) and reached())
    elif phase == "rename":
        rename = os.rename

        def hooked_rename(src: Any, dst: Any, *a: Any, **k: Any) -> None:
            before = seen % 2 == 0
            if before and ours(src):
                reached()
            rename(src, dst, *a, **k)
            if not before and ours(src):
                reached()

        os.rename = hooked_rename
    elif phase == "header":
        MemoryRegion.commit = _before(MemoryRegion.commit, lambda *_, **__: reached())  # type: ignore[method-assign]
    elif phase == "slot":

        def quiet(region: MemoryRegion, *_: Any, **__: Any) -> None:
            if seen + 1 == at:  # a persist's slot may still be committing: wait until both slots are
                while len(region.snapshots()) < 2:
                    time.sleep(0.01)
            reached()

        MemoryRegion.begin = _before(MemoryRegion.begin, quiet)  # type: ignore[method-assign]
    elif phase == "retention":
        rmtree = shutil.rmtree

        def hooked_rmtree(path: Any, *a: Any, **k: Any) -> None:
            if ".tmp-deleting-" in str(path):
                victims = sorted(os.listdir(path))
                if victims:
                    os.unlink(os.path.join(path, victims[0]))
                reached()
            rmtree(path, *a, **k)

        shutil.rmtree = hooked_rmtree


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _before(fn: Callable[..., Any], hook: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        hook(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapped


def _after(fn: Callable[..., Any], hook: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        hook(*args, **kwargs)
        return result

    return wrapped


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, loader: ResumableLoader) -> str:
    """SHA-256 over every bit of the training state that a resumed run must reproduce."""
    h = hashlib.sha256()
    for tensor in list(model.state_dict().values()) + [torch.get_rng_state()]:
        h.update(tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for entry in optimizer.state_dict()["state"].values():
        for value in entry.values():
            h.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    groups = optimizer.state_dict()["param_groups"]
    h.update(repr((groups, scheduler.state_dict(), loader.state_dict(), random.getstate())).encode())
    h.update(repr([v.tobytes() if isinstance(v, np.ndarray) else v for v in np.random.get_state()]).encode())
    return h.hexdigest()


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    progress = Progress(args.progress_fd)
    if args.hook:
        install_hook(args.hook, args.hook_at, progress, args.dir)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)
    loader = ResumableLoader(NoisySamples(args.samples), batch_size=args.batch_size, shuffle=True, seed=3)
    signals = tuple(signal.Signals(s) for s in args.save_on_signal)
    with cf.Checkpointer(
        args.dir,
        policy=args.every,
        keep=args.keep,
        save_on_signal=signals,
        memory=args.memory or False,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
    ) as ckpt:
        progress("ready", ckpt.restore())
        for _ in range(loader.epoch, args.epochs):
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                scheduler.step()
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                progress("optimizer", ckpt.global_step + 1)
                ckpt.step()
                progress("step", ckpt.global_step)
        ckpt.save(blocking=True)
    progress("final", state_digest(model, optimizer, scheduler, loader))


if __name__ == "__main__":
    run(parse())
