"""The step-boundary rule of docs/exactness.md: a loop that prefetches resumes exactly when the
prefetched batch is registered, as the page's example does, and does not when it is drawn anew."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import torch

from helpers import DOCS, assert_state_equal

PAGE = DOCS / "exactness.md"
READ_BACK = 'x, y = ckpt["batch"]'


def example() -> str:
    section = PAGE.read_text().split("## The step boundary", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run(workdir: Path, module: str, steps: int, out: str, *, killed: bool = False) -> None:
    """Train ``module``'s example to ``steps`` in a child process; SIGKILL it at the end if ``killed``."""
    code = (
        f"import os, signal, sys, torch; sys.path.insert(0, {str(workdir)!r}); torch.set_num_threads(1)\n"
        f"from {module} import train\n"
        f"model, opt = train({str(workdir / 'ckpt')!r}, {steps})\n"
        f"torch.save({{'model': model.state_dict(), 'optimizer': opt.state_dict()}}, {str(workdir / out)!r})\n"
        f"if {killed}: os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == (-signal.SIGKILL if killed else 0), proc.stderr


def test_prefetching_loop_resumes_exactly_when_the_batch_is_registered(tmp_path: Path) -> None:
    code = example()
    assert code.count(READ_BACK) == 1
    for name in ("reference", "resumed", "redrawn"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "documented.py").write_text(code)
        # nanoGPT's own resume: restore, then draw the first batch afresh
        (tmp_path / name / "redrawn.py").write_text(code.replace(READ_BACK, "x, y = get_batch()"))

    run(tmp_path / "reference", "documented", 12, "final.pt")
    run(tmp_path / "resumed", "documented", 7, "killed.pt", killed=True)  # newest checkpoint: step 5
    run(tmp_path / "resumed", "documented", 12, "final.pt")
    run(tmp_path / "redrawn", "documented", 7, "killed.pt", killed=True)
    run(tmp_path / "redrawn", "redrawn", 12, "final.pt")

    expected = torch.load(tmp_path / "reference" / "final.pt")
    resumed = torch.load(tmp_path / "resumed" / "final.pt")
    assert_state_equal(resumed["model"], expected["model"])
    assert_state_equal(resumed["optimizer"], expected["optimizer"])
    redrawn = torch.load(tmp_path / "redrawn" / "final.pt")
    assert not torch.equal(redrawn["model"]["0.weight"], expected["model"]["0.weight"])
