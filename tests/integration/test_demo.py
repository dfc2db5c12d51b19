"""The README's demo: a real job is killed with SIGKILL, resumes, and ends bit-identical."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from checkfreq.cli import app
from checkfreq.run.events import read_events
from checkfreq.tools.report import load_run, session_line


def demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "checkfreq.cli", "demo", *args], capture_output=True, text=True, timeout=600
    )


def test_demo_kills_resumes_and_matches_in_a_directory_it_creates(tmp_path: Path) -> None:
    workdir = tmp_path / "not" / "yet"
    result = demo("--steps", "120", "--seed", "3", "--dir", str(workdir))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "yes, bit for bit" in result.stdout
    assert "SIGKILL" in result.stdout
    lines = result.stdout.splitlines()
    checkpoints = workdir / "checkpoints"
    assert f"checkpoints in {checkpoints}" in lines[0]  # the path `checkfreq ls` and `report` take
    listing = json.loads(CliRunner().invoke(app, ["ls", str(checkpoints), "--json"]).output)
    assert listing and all(entry["valid"] for entry in listing)
    # each session's line is the one `checkfreq report` prints, overhead included; no wall-time comparison
    sessions = load_run(checkpoints).sessions
    assert len(sessions) == 2 and [session_line(s) for s in sessions] == [
        line for line in lines if line.startswith("session ")
    ]
    assert "wall time" not in result.stdout
    assert "n/a" not in result.stdout  # a session too short to measure says why (tests/unit/tools/test_report.py)
    killed = int(re.search(r"killed at step\s+(\d+)", result.stdout).group(1))  # type: ignore[union-attr]
    first, resumed = sessions
    assert resumed.restored_step is not None and 0 < resumed.restored_step <= killed
    # why the steps were lost, as the killed session's events tell it
    restored = resumed.restored_step
    why = next(line for line in lines if line.startswith("Why "))
    events = read_events(checkpoints)
    killed_session = events[: next(i for i, e in enumerate(events) if e["event"] == "start" and i > 0)]
    committed = {e["step"] for e in killed_session if e["event"] == "commit"}
    # a checkpoint durable before the kill, though its commit event was not written yet, is the one restored
    unfinished = [
        e["step"]
        for e in killed_session
        if e["event"] == "snapshot" and e["step"] not in committed and e["step"] > restored
    ]
    lost = f"Why {killed - restored} step{'s' if killed - restored != 1 else ''} lost: "
    if unfinished:
        assert why == (
            f"{lost}the checkpoint of step {unfinished[-1]} was still being written when the kill came "
            f"at step {killed}, so the newest durable one was that of step {restored}, the one before it."
        )
    else:
        interval = next(
            e["interval_steps"] for e in killed_session if e["event"] == "snapshot" and e["step"] == restored
        )
        assert why == (
            f"{lost}the kill came {killed - restored} steps after the newest checkpoint, that of step "
            f"{restored} (which came {interval} steps after the one before it), before the policy's "
            "next one was due."
        )
    # what the resumed session took over from the checkpoint, in words
    assert "took over the step and checkpoint costs measured before" in lines[-2] and "carried:" not in result.stdout
    rate = first.checkpoints / killed
    # no back-to-back checkpoints
    assert resumed.checkpoints / (120 - resumed.restored_step) <= 2 * rate + 0.05, sessions


def test_demo_refuses_a_directory_it_cannot_use_before_training(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    result = demo("--steps", "120", "--dir", str(tmp_path / "a-file" / "demo"))
    assert result.returncode == 2 and "--dir" in result.stderr and "cannot create" in result.stderr, result.stderr
    assert "SIGKILL" not in result.stdout  # nothing trained
