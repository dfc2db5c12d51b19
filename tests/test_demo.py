"""The README's demo: a real job is killed with SIGKILL, resumes, and ends bit-identical."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_demo_kills_resumes_and_matches(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "checkfreq.cli", "demo", "--steps", "120", "--seed", "3", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "yes, bit for bit" in result.stdout
    assert "SIGKILL" in result.stdout
    assert any((tmp_path / "checkpoints").glob("step_*"))
