"""The README's usage example runs as written, resumes instead of starting over, and a run of it
killed with SIGKILL and started again ends bit-identical to one never killed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from checkfreq.cli import app
from checkfreq.run.events import read_events
from helpers import README

KILL_AT = 45  # an optimizer step in the second of the example's three epochs of 32 steps

# Around the example, never inside it: a stop after optimizer step $STOP_AT, once a checkpoint is
# committed to resume from (where the test's SIGKILL lands), and a digest of everything a resumed
# run must reproduce.
PRELUDE = """\
import glob as _glob, os as _os, time as _time
from torch.optim.optimizer import register_optimizer_step_post_hook as _after_every_step
_steps = 0
def _stop(*_):
    global _steps
    _steps += 1
    if _steps == int(_os.environ.get("STOP_AT", 0)):
        deadline = _time.monotonic() + 120
        while not [p for p in _glob.glob("runs/exp1/step_*") if ".tmp-" not in p] and _time.monotonic() < deadline:
            _time.sleep(0.01)
        print("STOPPED", flush=True)
        _time.sleep(300)
_after_every_step(_stop)
"""
DIGEST = """
import hashlib as _hashlib
_h = _hashlib.sha256()
_opt = [v for s in optimizer.state_dict()["state"].values() for v in s.values()]
for _t in [*model.state_dict().values(), *_opt, torch.get_rng_state()]:
    _h.update(_t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
_h.update(repr((optimizer.state_dict()["param_groups"], loader.state_dict())).encode())
print("DIGEST", _h.hexdigest())
"""


def example() -> str:
    """The code block of the README's "Use" section, as users copy it."""
    return re.search(r"## Use\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)  # type: ignore[union-attr]


def test_readme_example_runs_and_resumes(tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(example() + "\nprint('STEP', ckpt.global_step)\n")
    first = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "STEP 96" in first.stdout  # 3 epochs of ceil(1000 / 32) = 32 batches
    # a newcomer sees it work: a line per epoch, and no restore on a fresh run
    assert re.findall(r"^epoch (\d): step (\d+), loss \d+\.\d{3}$", first.stdout, re.M) == [
        ("0", "32"),
        ("1", "64"),
        ("2", "96"),
    ], first.stdout
    assert "restored" not in first.stdout
    assert (tmp_path / "runs" / "exp1" / "step_000000096" / "manifest.json").exists()
    second = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "STEP 96" in second.stdout  # restored at the end: nothing left to train
    assert second.stdout.splitlines()[0] == "restored from step 96" and "epoch" not in second.stdout


def _digest(script: Path, cwd: Path) -> str:
    done = subprocess.run([sys.executable, str(script)], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    _printed[cwd.name] = done.stdout
    return done.stdout.split("DIGEST ")[1].strip()


_printed: dict[str, str] = {}
"""What each run of ``_digest`` printed, by the name of the directory it ran in."""


def test_readme_example_killed_with_sigkill_and_rerun_ends_bit_identical(tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(PRELUDE + example() + DIGEST)
    (tmp_path / "uninterrupted").mkdir()
    (tmp_path / "killed").mkdir()
    reference = _digest(script, tmp_path / "uninterrupted")

    env = {**os.environ, "STOP_AT": str(KILL_AT)}
    with subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path / "killed",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdout is not None
        before_kill = []
        for line in child.stdout:  # the first epoch's line, then the stop (or the end, if it failed)
            if line == "STOPPED\n":
                break
            before_kill.append(line)
        assert line == "STOPPED\n", child.stderr.read()  # type: ignore[union-attr]
        assert len(before_kill) == 1 and re.fullmatch(r"epoch 0: step 32, loss \d+\.\d{3}\n", before_kill[0])
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    run = tmp_path / "killed" / "runs" / "exp1"
    assert any(p for p in run.glob("step_*") if ".tmp-" not in p.name), "the killed run committed no checkpoint"

    assert _digest(script, tmp_path / "killed") == reference
    restored = [e["step"] for e in read_events(run) if e["event"] == "restore"]
    assert len(restored) == 1 and 0 < restored[0] <= KILL_AT, restored  # resumed mid-run, not from scratch
    resumed = _printed["killed"].splitlines()
    assert resumed[0] == f"restored from step {restored[0]}", resumed
    epoch = restored[0] // 32  # the epoch it resumed in is the first it reports
    assert re.fullmatch(rf"epoch {epoch}: step {32 * (epoch + 1)}, loss \d+\.\d{{3}}", resumed[1]), resumed

    # `checkfreq diff` of the two runs' last checkpoints: no tensor and no other value differs, the
    # generators' states included (Python's is a value, NumPy's and torch's are tensors)
    result = CliRunner().invoke(app, ["diff", str(tmp_path / "uninterrupted" / "runs" / "exp1"), str(run), "--json"])
    assert result.exit_code == 0, result.output
    compared = json.loads(result.output)
    assert compared["identical"] and compared["step_a"] == compared["step_b"] == 96
    assert {"rng/numpy/state/key", "rng/torch"} <= {t["name"] for t in compared["tensors"]}
    assert any(v["name"].startswith("rng/python") for v in compared["values"])
