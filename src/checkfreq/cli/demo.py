"""``checkfreq demo``: train, SIGKILL mid-run, resume, and compare with an uninterrupted run."""

from __future__ import annotations

import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from safetensors.torch import load_file

from checkfreq.cli import app
from checkfreq.events import read_events
from checkfreq.report import SessionSummary, load_run

console = Console()


@dataclass
class Segment:
    """What one training process did, as seen from its stdout."""

    resumed_from: int = 0
    last_step: int = 0
    step_times: list[float] = field(default_factory=list)
    killed: bool = False

    @property
    def seconds_per_step(self) -> float:
        times = self.step_times
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")


def _run(args: list[str], label: str, steps: int, progress: Progress, kill_at: int | None = None) -> Segment:
    """Run the example job, show its progress, and SIGKILL it when it reports step ``kill_at``."""
    command = [sys.executable, "-m", "checkfreq.examples.charlm", *args, "--steps", str(steps)]
    task = progress.add_task(label, total=steps)
    segment = Segment()
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as child:
        assert child.stdout is not None
        for line in child.stdout:
            record = json.loads(line)
            if "resumed_from" in record:
                segment.resumed_from = segment.last_step = record["resumed_from"]
                progress.update(task, completed=segment.last_step)
            elif "step" in record:
                segment.last_step = record["step"]
                segment.step_times.append(time.perf_counter())
                progress.update(task, completed=segment.last_step)
                if segment.last_step == kill_at:
                    child.send_signal(signal.SIGKILL)
                    segment.killed = True
                    break
        code = child.wait()
    if code not in (0, -signal.SIGKILL) or (code and not segment.killed):
        raise typer.Exit(f"the training process failed with exit code {code}")  # type: ignore[arg-type]
    return segment


def _identical(a: Path, b: Path) -> bool:
    left, right = load_file(str(a)), load_file(str(b))
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


@app.command()
def demo(
    steps: int = typer.Option(600, help="optimizer steps of the training job"),
    directory: Path = typer.Option(None, "--dir", help="where to keep the run (default: a temporary directory)"),
    seed: int = typer.Option(None, help="seed for choosing the kill step (default: random)"),
) -> None:
    """Train a small language model, SIGKILL it mid-run, resume it, and check it ends bit-identical."""
    workdir = Path(directory or tempfile.mkdtemp(prefix="checkfreq-demo-"))
    checkpoints = workdir / "checkpoints"
    if checkpoints.exists() and any(checkpoints.iterdir()):
        raise typer.BadParameter(f"{checkpoints} is not empty; give a fresh --dir")
    kill_at = random.Random(seed).randint(int(0.35 * steps), int(0.65 * steps))
    console.print(f"[bold]checkfreq demo[/]: character-level LM on Python's own source, {steps} steps, "
                  f"SIGKILL at step {kill_at}; files in {workdir}")
    columns = (TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        reference = _run(["--out", str(workdir / "uninterrupted.safetensors")], "uninterrupted (no checkpoints)",
                         steps, progress)
        first = _run([str(checkpoints), "--out", str(workdir / "unused.safetensors")], "checkpointed, then killed",
                     steps, progress, kill_at=kill_at)
        resumed = _run([str(checkpoints), "--out", str(workdir / "resumed.safetensors")], "restarted, resumes",
                       steps, progress)
    _summary(workdir, checkpoints, reference, first, resumed)


def _summary(workdir: Path, checkpoints: Path, reference: Segment, first: Segment, resumed: Segment) -> None:
    events = read_events(checkpoints)
    stalls = _stall_per_checkpoint(events)
    commits = [e["step"] for e in events if e["event"] == "commit"]
    sessions = load_run(checkpoints).sessions
    identical = _identical(workdir / "uninterrupted.safetensors", workdir / "resumed.safetensors")

    table = Table(show_header=False, box=None)
    table.add_row("checkpoints committed", f"{len(commits)} (steps {_ranges(commits)})")
    if stalls:
        table.add_row("stall per checkpoint", f"median {statistics.median(stalls) * 1e3:.1f} ms, max {max(stalls) * 1e3:.1f} ms")
    table.add_row("killed at step", f"{first.last_step} (SIGKILL)")
    table.add_row("resumed from step", f"{resumed.resumed_from} (lost {first.last_step - resumed.resumed_from} steps)")
    table.add_row("time per step", f"{reference.seconds_per_step * 1e3:.1f} ms uninterrupted (no checkpoints)")
    for label, segment, session in (("first session", first, sessions[0]), ("resumed session", resumed, sessions[-1])):
        table.add_row(label, _session_row(segment, session, reference))
    table.add_row("", "overhead by wall time: time per step against the uninterrupted run's (one run each on a "
                  "shared machine: noisy); by the event log: as `checkfreq report` measures it")
    table.add_row("resumed == uninterrupted", "[green]yes, bit for bit[/]" if identical else "[red]NO[/]")
    console.print(table)
    if not identical:
        raise typer.Exit(1)


def _session_row(segment: Segment, session: SessionSummary, reference: Segment) -> str:
    """A session's steps, checkpoints, time per step and overhead (by wall time and by the event log)."""
    steps = segment.last_step - segment.resumed_from
    by_wall = segment.seconds_per_step / reference.seconds_per_step - 1
    by_log = "n/a" if session.overhead is None else f"{session.overhead:.1%}"
    return (f"{session.checkpoints} checkpoints in {steps} steps, {segment.seconds_per_step * 1e3:.1f} ms per step, "
            f"overhead {by_wall:+.1%} by wall time, {by_log} by the event log")


def _stall_per_checkpoint(events: list[dict]) -> list[float]:
    """Total stall of each checkpoint: the fence record's when there is one, else the snapshot's."""
    stalls: dict[tuple[float, int], float] = {}
    run = 0.0
    for e in events:
        if e["event"] == "start":
            run = e["time"]
        if e["event"] in ("snapshot", "fence") and e.get("stall_s") is not None:
            stalls[(run, e["step"])] = e["stall_s"]
    return list(stalls.values())


def _ranges(steps: list[int]) -> str:
    if len(steps) <= 6:
        return ", ".join(map(str, steps))
    return f"{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-2:]))}"
