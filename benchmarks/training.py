"""A real CPU training loop (an MLP learning a fixed random teacher), checkpointed in several ways.

Every variant trains the same model from the same seed; each variant run sits between two
no-checkpoint runs, which are its reference. Per run we keep every iteration's time, the stall
of each checkpoint (the save call, plus for checkfreq the extra time of the next
``optimizer.step()``, where the fence waits for the deferred copies) and which iterations
overlapped a background persist.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import checkfreq as cf
from checkfreq.policies import resolve

POOL = 32


@dataclass(frozen=True)
class Workload:
    widths: tuple[int, ...]
    batch: int
    steps: int


FULL = Workload(widths=(1024, 2048, 2048, 2048, 1024, 10), batch=128, steps=200)
QUICK = Workload(widths=(64, 128, 10), batch=32, steps=8)


@dataclass
class Run:
    """What one training run measured (seconds)."""

    spans: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) of every iteration, ``time.time()``."""
    stalls: list[float] = field(default_factory=list)
    checkpoint_steps: list[int] = field(default_factory=list)
    persisting: list[bool] = field(default_factory=list)


class Saver:
    """Checkpointing inside the loop: ``after_step`` runs after each ``optimizer.step()``."""

    def start(self, model: nn.Module, opt: torch.optim.Optimizer, run: Run, workdir: Path) -> None:
        self.run, self.workdir = run, workdir

    def after_step(self, i: int, opt_seconds: list[float]) -> None:
        """Called at the end of iteration ``i``."""

    def finish(self) -> None:
        """After the last step; may mark ``run.persisting``."""


def make_model(widths: tuple[int, ...]) -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def train(workload: Workload, steps: int, saver: Saver, workdir: Path) -> Run:
    """Train ``steps`` iterations from seed 0 and checkpoint through ``saver``."""
    torch.manual_seed(0)
    model = make_model(workload.widths)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    teacher = nn.Linear(workload.widths[0], workload.widths[-1])
    with torch.no_grad():
        xs = [torch.randn(workload.batch, workload.widths[0]) for _ in range(POOL)]
        data = [(x, teacher(x).argmax(1)) for x in xs]
    run = Run()
    saver.start(model, opt, run, workdir)
    opt_seconds: list[float] = []
    for i in range(steps):
        begin = time.time()
        x, y = data[i % POOL]
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        opt_seconds.append(time.perf_counter() - t0)
        saver.after_step(i, opt_seconds)
        run.spans.append((begin, time.time()))
    saver.finish()
    return run


class NoSave(Saver):
    pass


class CheckfreqSaver(Saver):
    """A ``Checkpointer`` with ``policy`` (and ``memory``); iterations overlapping a persist come from
    ``events.jsonl``."""

    def __init__(self, policy: Any, memory: bool | int = False) -> None:
        self.policy, self.memory = policy, memory

    def start(self, model: nn.Module, opt: torch.optim.Optimizer, run: Run, workdir: Path) -> None:
        super().start(model, opt, run, workdir)
        self.ckpt = cf.Checkpointer(
            workdir / "checkfreq", model=model, optimizer=opt, policy=self.policy, keep=2, memory=self.memory
        )
        self.pending: float | None = None

    def after_step(self, i: int, opt_seconds: list[float]) -> None:
        if self.pending is not None:  # this iteration's optimizer step ran the fence
            typical = statistics.median(opt_seconds[-21:-1])
            self.run.stalls.append(self.pending + max(opt_seconds[-1] - typical, 0.0))
            self.pending = None
        t0 = time.perf_counter()
        if self.ckpt.step():
            self.pending = time.perf_counter() - t0
            self.run.checkpoint_steps.append(i)

    def finish(self) -> None:
        self.ckpt.close()
        spans, start = [], None
        for line in (self.ckpt.directory / "events.jsonl").read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "snapshot":
                start = event["time"]
            elif event["event"] in ("commit", "error") and start is not None:
                spans.append((start, event["time"]))
                start = None
        self.run.persisting = [any(b < end and e > begin for begin, end in spans) for b, e in self.run.spans]


class TorchSaveSaver(Saver):
    """``torch.save`` + ``fsync`` every ``interval`` steps, synchronous."""

    def __init__(self, interval: int) -> None:
        self.interval = interval

    def start(self, model: nn.Module, opt: torch.optim.Optimizer, run: Run, workdir: Path) -> None:
        super().start(model, opt, run, workdir)
        self.model, self.opt = model, opt

    def after_step(self, i: int, opt_seconds: list[float]) -> None:
        if (i + 1) % self.interval:
            return
        t0 = time.perf_counter()
        path = self.workdir / f"step{i % 2}.pt"
        with open(path, "wb") as f:
            torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        self.run.stalls.append(time.perf_counter() - t0)
        self.run.checkpoint_steps.append(i)


class DcpAsyncSaver(Saver):
    """``dcp.async_save`` (thread executor, persistent cached ``DefaultStager``) every ``interval`` steps.

    One save in flight, as with checkfreq: waiting for the previous upload is part of the stall.
    """

    def __init__(self, interval: int) -> None:
        self.interval = interval

    def start(self, model: nn.Module, opt: torch.optim.Optimizer, run: Run, workdir: Path) -> None:
        super().start(model, opt, run, workdir)
        self.model, self.opt = model, opt
        self.stager = DefaultStager(StagingOptions(False, False, False, False))
        self.future: Any = None

    def after_step(self, i: int, opt_seconds: list[float]) -> None:
        self.run.persisting.append(self.future is not None and not self.future.done())
        if (i + 1) % self.interval:
            return
        t0 = time.perf_counter()
        if self.future is not None:
            self.future.result()
        state = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}
        path = self.workdir / f"dcp{i % 3}"
        self.future = dcp.async_save(
            state, storage_writer=dcp.FileSystemWriter(path), async_stager=self.stager, no_dist=True
        )
        self.run.stalls.append(time.perf_counter() - t0)
        self.run.checkpoint_steps.append(i)

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()
        self.stager.close()


def variants(intervals: tuple[int, ...]) -> dict[str, Callable[[], Saver]]:
    """Every loop variant by name; ``auto`` is whatever the Checkpointer's default policy resolves to."""
    out: dict[str, Callable[[], Saver]] = {"no checkpoints": NoSave}
    for n in intervals:
        out[f"checkfreq every {n}"] = lambda n=n: CheckfreqSaver(cf.Every(n=n))
    out[f"checkfreq auto ({type(resolve('auto')).__name__})"] = lambda: CheckfreqSaver("auto")
    for n in intervals:
        out[f"torch.save+fsync every {n}"] = lambda n=n: TorchSaveSaver(n)
    for n in intervals:
        out[f"DCP async_save every {n}"] = lambda n=n: DcpAsyncSaver(n)
    return out


def steps_for(name: str, workload: Workload) -> int:
    """Synchronous-ish baselines at every step run a quarter as long (their cost per step is the same)."""
    slow = name.endswith(" every 1") and not name.startswith("checkfreq")
    return max(workload.steps // 4, 8) if slow else workload.steps


def bench_training(workload: Workload, repeats: int, intervals: tuple[int, ...]) -> dict[str, Any]:
    """Every variant, each between two no-checkpoint runs (N A N B N …), in rounds of rotated order.

    Each variant is compared with the no-checkpoint runs just before and after it, so a load
    change on a shared machine moves both sides of a ratio alike.
    """
    table = variants(intervals)
    names = [n for n in table if n != "no checkpoints"]
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in table}
    with tempfile.TemporaryDirectory(prefix="cf-train-") as tmp:
        train(workload, max(workload.steps // 4, 2), NoSave(), Path(tmp))  # warm-up
        seq = 0

        def baseline() -> int:
            nonlocal seq
            seq += 1
            workdir = Path(tmp) / f"none-{seq}"
            workdir.mkdir()
            run = train(workload, workload.steps, NoSave(), workdir)
            results["no checkpoints"].append({"seq": seq, **run.__dict__})
            return seq

        for round_ in range(repeats):
            shift = round_ % len(names)
            before = baseline()
            for name in names[shift:] + names[:shift]:
                workdir = Path(tmp) / f"{round_}-{names.index(name)}"
                workdir.mkdir()
                run = train(workload, steps_for(name, workload), table[name](), workdir)
                after = baseline()
                results[name].append({"round": round_, "ref": [before, after], **run.__dict__})
                before = after
    params = sum(p.numel() for p in make_model(workload.widths).parameters())
    return {
        "params": params,
        "state_bytes": params * 12,
        "batch": workload.batch,
        "steps": workload.steps,
        "intervals": list(intervals),
        "runs": results,
    }
