"""The README's usage example runs as written, and a second run resumes instead of starting over."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_readme_example_runs_and_resumes(tmp_path: Path) -> None:
    code = re.search(r"## Use\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code + "\nprint('STEP', ckpt.global_step)\n")
    first = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "STEP 96" in first.stdout  # 3 epochs of ceil(1000 / 32) = 32 batches
    assert (tmp_path / "runs" / "exp1" / "step_000000096" / "manifest.json").exists()
    second = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "STEP 96" in second.stdout  # restored at the end: nothing left to train
