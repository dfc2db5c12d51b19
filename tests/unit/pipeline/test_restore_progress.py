"""A restore that reads at least the progress threshold (1 GB; lowered here through its environment
variable) logs its progress at INFO; a smaller one logs none."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

import checkfreq as cf
from checkfreq.storage.progress import PROGRESS_BYTES_ENV
from helpers import make_model, train_step


def _restore_messages(directory: Path, caplog: pytest.LogCaptureFixture) -> tuple[int, list[str]]:
    model = make_model(width=512)
    opt = torch.optim.Adam(model.parameters())
    caplog.clear()
    with (
        caplog.at_level(logging.INFO, logger="checkfreq.restore"),
        cf.Checkpointer(directory, model=model, optimizer=opt) as ckpt,
    ):
        step = ckpt.restore()
    return step, [r.getMessage() for r in caplog.records if r.name == "checkfreq.restore" and "read" in r.getMessage()]


def test_a_restore_over_the_threshold_logs_its_progress(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model(width=512)
    opt = torch.optim.Adam(model.parameters())
    with cf.Checkpointer(tmp_path, policy=3, model=model, optimizer=opt) as ckpt:
        for _ in range(3):
            train_step(model, opt)
            ckpt.step()
    size = (tmp_path / "step_000000003" / "rank00000.safetensors").stat().st_size

    step, quiet = _restore_messages(tmp_path, caplog)
    assert step == 3 and quiet == []  # a few hundred kB: under 1 GB

    monkeypatch.setenv(PROGRESS_BYTES_ENV, str(size // 2))
    step, messages = _restore_messages(tmp_path, caplog)
    assert step == 3
    assert messages[0] == f"restore of step_000000003: reading and verifying {size / 1e9:.2f} GB"
    last = re.fullmatch(
        r"restore of step_000000003: ([\d.]+) of ([\d.]+) GB read and verified \(100 %, \d+ MB/s\)", messages[-1]
    )
    assert last is not None and last.group(1) == last.group(2) == f"{size / 1e9:.2f}", messages
