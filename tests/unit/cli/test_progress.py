"""The progress bar of ``verify``, ``export`` and ``diff``: on a terminal (a real pty) for a
checkpoint at or over the threshold; never with ``--json``, through a pipe, or under the threshold."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import checkfreq as cf
from checkfreq.cli.progress import PROGRESS_BYTES, PROGRESS_BYTES_ENV
from helpers import make_model, train_step

BAR = "━"  # rich's bar


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("progress") / "run"
    model = make_model(width=256)
    opt = torch.optim.Adam(model.parameters())
    with cf.Checkpointer(directory, policy=2, keep=3, model=model, optimizer=opt) as ckpt:
        for _ in range(6):
            train_step(model, opt)
            ckpt.step()
    return directory


def _env(threshold: int | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != PROGRESS_BYTES_ENV}
    env.update(TERM="xterm-256color", COLUMNS="120", LINES="40")
    if threshold is not None:
        env[PROGRESS_BYTES_ENV] = str(threshold)
    return env


def on_a_terminal(args: list[str], threshold: int | None) -> tuple[int, str]:
    """Run ``checkfreq ARGS`` with stdout on a pseudo-terminal; its exit status and what it showed there."""
    leader, follower = pty.openpty()
    child = subprocess.Popen(
        [sys.executable, "-m", "checkfreq.cli", *args], stdout=follower, stderr=subprocess.PIPE, env=_env(threshold)
    )
    os.close(follower)
    shown = b""
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not data:
            break
        shown += data
    os.close(leader)
    assert child.wait(timeout=120) in (0, 1), child.stderr.read()  # type: ignore[union-attr]
    return child.returncode, shown.decode(errors="replace")


def through_a_pipe(args: list[str], threshold: int | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "checkfreq.cli", *args], capture_output=True, text=True, env=_env(threshold), timeout=120
    )


def test_the_threshold_is_a_gigabyte_unless_set() -> None:
    assert PROGRESS_BYTES == 1_000_000_000


def test_verify_shows_a_bar_on_a_terminal_at_the_threshold(run: Path) -> None:
    code, shown = on_a_terminal(["verify", str(run)], threshold=1)
    assert code == 0
    assert "verifying run" in shown and BAR in shown and "kB" in shown
    assert "3 of 3 checkpoints verified" in shown  # the result still follows


def test_no_bar_under_the_threshold_with_json_or_through_a_pipe(run: Path) -> None:
    code, shown = on_a_terminal(["verify", str(run)], threshold=None)  # kilobytes, under 1 GB
    assert code == 0 and "verifying" not in shown and BAR not in shown
    code, shown = on_a_terminal(["verify", str(run), "--json"], threshold=1)
    assert code == 0 and BAR not in shown and json.loads(shown.replace("\r\n", "\n"))["ok"] is True
    piped = through_a_pipe(["verify", str(run)], threshold=1)
    assert piped.returncode == 0 and "verifying" not in piped.stdout and BAR not in piped.stdout + piped.stderr


def test_export_and_diff_show_a_bar_on_a_terminal(run: Path, tmp_path: Path) -> None:
    code, shown = on_a_terminal(["export", str(run), "--to", str(tmp_path / "w.safetensors")], threshold=1)
    assert code == 0 and "reading run" in shown and BAR in shown and "exported" in shown
    newest, older = sorted(p for p in run.glob("step_*"))[::-1][:2]
    code, shown = on_a_terminal(["diff", str(older), str(newest)], threshold=1)
    assert code == 1 and f"reading {older.name} and {newest.name}" in shown and BAR in shown
    piped = through_a_pipe(["diff", str(older), str(newest)], threshold=1)
    assert piped.returncode == 1 and BAR not in piped.stdout
