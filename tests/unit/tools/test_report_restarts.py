"""What each restart cost, in ``checkfreq report``: a real process killed after step 7 (checkpoints
every 2 steps) and started again, which restores step 6 and trains one step over."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from checkfreq.tools.report import load_run, summary_text
from checkfreq.tools.report_restarts import restarts

SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, checkfreq as cf
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = cf.Checkpointer(sys.argv[1], policy=cf.Every(2), model=model, optimizer=optimizer)
    step = ckpt.restore()
    while step < int(sys.argv[2]):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        ckpt.step()
        step += 1
    ckpt.wait()
    if sys.argv[3] == "kill":
        os.kill(os.getpid(), 9)
    ckpt.close()
    """
)


def _run(directory: Path, until: int, end: str) -> int:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(directory), str(until), end], timeout=300).returncode


def test_a_killed_run_started_again_reports_what_its_restart_cost(tmp_path: Path) -> None:
    assert _run(tmp_path, 7, "kill") == -9  # checkpoints 2, 4, 6 committed; step 7's events name it
    assert _run(tmp_path, 9, "close") == 0
    report = load_run(tmp_path)
    (restart,) = report.restarts
    assert (restart.restored, restart.tier) == (6, "local")
    assert restart.replayed >= 0 and restart.restore_s > 0
    assert restart.down_s is not None and 0 < restart.down_s < 300  # the last event, then the new process
    assert restart.script_s is not None and 0 < restart.script_s < 300  # the interpreter and torch's imports
    assert "restarts: 1, each (median) down " in summary_text(report)
    assert restarts([{"event": "start", "time": 1.0, "rank": 0}]) == []  # a first start is no restart
