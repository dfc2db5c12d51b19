"""How a step is timed: from one ``step()`` to the next, also when a checkpoint was captured in between."""

from __future__ import annotations

import time
from pathlib import Path

import torch

import checkfreq as cf
from checkfreq.run.events import read_events
from helpers import make_model, train_step

WORK = 0.05
"""Seconds of the loop's own work after each ``step()`` (logging, preparing the next batch)."""


def test_a_step_after_a_checkpoint_counts_the_loops_work_since_step(tmp_path: Path) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with cf.Checkpointer(tmp_path, policy=3, model=model, optimizer=opt) as ckpt:
        for _ in range(12):
            train_step(model, opt)  # its forward is the consistent point where a decided checkpoint is captured
            ckpt.step()
            time.sleep(WORK)
        estimate = ckpt.profiler.iteration_while_persisting.value
    # Timed from the capture instead, a step after a checkpoint looked as short as its forward and backward
    # (a few ms), and so did the smoothed estimate the report's iteration panel draws.
    assert estimate > 0.8 * WORK, estimate
    panel = [e["iteration_persisting_s"] for e in read_events(tmp_path) if e["event"] == "snapshot"][1:]
    assert panel and all(value > 0.8 * WORK for value in panel), panel
