"""``checkfreq demo``: train, SIGKILL mid-run, resume, and compare with an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from safetensors.torch import load_file

from checkfreq.cli import app
from checkfreq.tools.report import RunReport, human_seconds, load_run, session_line

console = Console()

MIN_STEPS = 40
"""Fewest ``--steps`` the demo shows anything with: the default policy's first checkpoint comes after
its 10 warm-up steps, and the kill at 35-65 % of the run must come after that checkpoint is durable."""


@dataclass
class Segment:
    """What one training process did, as seen from its stdout."""

    resumed_from: int = 0
    last_step: int = 0
    killed: bool = False


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
    if steps < MIN_STEPS:
        raise typer.BadParameter(
            f"{steps} is too few: the first checkpoint comes after 10 warm-up steps and the kill at 35-65 % of the "
            f"run must come after it, or the restart resumes nothing; give at least {MIN_STEPS}",
            param_hint="--steps",
        )
    workdir = _workdir(directory)
    checkpoints = workdir / "checkpoints"
    if checkpoints.exists() and any(checkpoints.iterdir()):
        raise typer.BadParameter(f"{checkpoints} is not empty; give a fresh --dir", param_hint="--dir")
    kill_at = random.Random(seed).randint(int(0.35 * steps), int(0.65 * steps))
    console.print(
        f"[bold]checkfreq demo[/]: character-level LM on Python's own source, {steps} steps, "
        f"SIGKILL at step {kill_at}; checkpoints in {checkpoints}",
        soft_wrap=True,
    )
    columns = (TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        _run(["--out", str(workdir / "uninterrupted.safetensors")], "uninterrupted (no checkpoints)", steps, progress)
        first = _run(
            [str(checkpoints), "--out", str(workdir / "unused.safetensors")],
            "checkpointed, then killed",
            steps,
            progress,
            kill_at=kill_at,
        )
        resumed = _run(
            [str(checkpoints), "--out", str(workdir / "resumed.safetensors")], "restarted, resumes", steps, progress
        )
    _summary(workdir, checkpoints, first, resumed)


def _workdir(directory: Path | None) -> Path:
    """The demo's directory: a new temporary one, or ``directory``, created if missing; a directory
    that cannot be created or written to is refused here, before any training."""
    if directory is None:
        return Path(tempfile.mkdtemp(prefix="checkfreq-demo-"))
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise typer.BadParameter(f"cannot create {directory}: {e.strerror}", param_hint="--dir") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise typer.BadParameter(f"{directory} is not writable", param_hint="--dir")
    return directory


def _summary(workdir: Path, checkpoints: Path, first: Segment, resumed: Segment) -> None:
    run = load_run(checkpoints)
    assert run.summary is not None
    commits = [r.step for r in run.records if r.status == "committed"]
    identical = _identical(workdir / "uninterrupted.safetensors", workdir / "resumed.safetensors")

    table = Table(show_header=False, box=None)
    table.add_row("checkpoints committed", f"{len(commits)} (steps {_ranges(commits)})" if commits else "none")
    if commits:
        table.add_row(
            "stall per checkpoint",
            f"median {human_seconds(run.summary.stall_median_s)}, max {human_seconds(run.summary.stall_max_s)}",
        )
    table.add_row("killed at step", f"{first.last_step} (SIGKILL)")
    table.add_row("resumed from step", f"{resumed.resumed_from} (lost {first.last_step - resumed.resumed_from} steps)")
    table.add_row("resumed == uninterrupted", verdict_text(identical, resumed.resumed_from))
    console.print(table)
    lost = first.last_step - resumed.resumed_from
    why = lost_text(run, first.last_step, resumed.resumed_from)
    console.print(f"Why {lost} step{'s' if lost != 1 else ''} lost: {why}.", soft_wrap=True, highlight=False)
    console.print(
        "Each session's checkpoints and overhead, measured per window between checkpoints "
        "(as `checkfreq report` gives them):"
    )
    for session in run.sessions:
        console.print(session_line(session), soft_wrap=True, highlight=False)
    console.print(
        f"Look closer: checkfreq ls {checkpoints}; checkfreq report {checkpoints}", soft_wrap=True, highlight=False
    )
    if not identical or not resumed.resumed_from:
        raise typer.Exit(1)


def verdict_text(identical: bool, resumed_from: int) -> str:
    """Whether the resumed run ended as the uninterrupted one did; a restart that restored nothing
    trained from the start, which shows nothing about resuming."""
    if not identical:
        return "[red]NO[/]"
    if not resumed_from:
        return "[yellow]not shown[/]: nothing was restored, so the restart trained from step 0"
    return "[green]yes, bit for bit[/]"


def lost_text(run: RunReport, killed: int, restored: int) -> str:
    """Why the kill at step ``killed`` cost the steps since ``restored``, from the killed session's events."""
    killed_session = [r for r in run.records if r.session == 0]
    unfinished = [r for r in killed_session if r.step > restored and r.status != "committed"]
    if unfinished:
        r = unfinished[-1]
        what = "had failed" if r.status == "failed" else "was still being written"
        return (
            f"the checkpoint of step {r.step} {what} when the kill came at step {killed}, so the newest "
            f"durable one was that of step {restored}, the one before it"
        )
    skipped = [name for restore in run.restores for name, _ in restore.get("skipped", [])]
    if skipped:
        return f"the restore passed over {', '.join(skipped)} as invalid (`checkfreq ls` says why)"
    if restored == 0:
        return "the kill came before the first checkpoint was durable"
    newest = next((r for r in killed_session if r.step == restored), None)
    interval = (
        f" (which came {newest.interval_steps} steps after the one before it)"
        if newest and newest.interval_steps
        else ""
    )
    return (
        f"the kill came {killed - restored} steps after the newest checkpoint, that of step {restored}"
        f"{interval}, before the policy's next one was due"
    )


def _ranges(steps: list[int]) -> str:
    if len(steps) <= 6:
        return ", ".join(map(str, steps))
    return f"{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-2:]))}"
