"""The README's demo: a real job is killed with SIGKILL, resumes, and ends bit-identical."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from checkfreq.report import load_run


def test_demo_kills_resumes_and_matches(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "checkfreq.cli", "demo", "--steps", "120", "--seed", "3", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "yes, bit for bit" in result.stdout
    assert "SIGKILL" in result.stdout
    assert any((tmp_path / "checkpoints").glob("step_*"))
    # each session's checkpoints and overhead, beside each other, as the event log counts them
    text = " ".join(result.stdout.split())
    rows = re.findall(r"(first|resumed) session (\d+) checkpoints in (\d+) steps, [\d.]+ ms per step, overhead [+-][\d.]+% "
                      r"by wall time, (?:[-\d.]+%|n/a) by the event log", text)
    sessions = load_run(tmp_path / "checkpoints").sessions
    assert [(label, int(n)) for label, n, _ in rows] == [("first", sessions[0].checkpoints), ("resumed", sessions[1].checkpoints)], text
    (_, first, first_steps), (_, resumed, resumed_steps) = rows
    assert int(resumed) / int(resumed_steps) <= 2 * int(first) / int(first_steps) + 0.05, text  # no back-to-back checkpoints
