"""CheckFreqCallback(monitor="val_loss", mode="min", save_top_k=2) keeps the newest ``keep`` checkpoints and
the two best by the validation's ``val_loss``, as Lightning's ``ModelCheckpoint`` would by the same options.

Each run is ``scripts/lightning_best.py`` (5 epochs of 6 steps, a checkpoint every 4, a validation whose loss
has a noise of the step) in a child process: straight through, SIGKILLed at step 14 then resumed, and with a
validation every 3 batches (mid-epoch). Skipped when the ``lightning`` extra is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import checkfreq as cf
from checkfreq.integrations.lightning import CheckFreqCallback
from checkfreq.storage.base import Aside
from checkfreq.storage.local import LocalStore
from helpers import SCRIPTS, assert_state_equal

pytest.importorskip("lightning")
pytestmark = pytest.mark.slow


def _fit(directory: Path, out: Path, kill_step: int = 0, *extra: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "lightning_best.py"), str(directory), str(out), str(kill_step), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == (-signal.SIGKILL if kill_step else 0), proc.stderr[-3000:]


def _evaluations(out: Path) -> dict[int, float]:
    logged: dict[int, float] = {}
    for line in Path(f"{out}.evals").read_text().splitlines():
        record = json.loads(line)
        assert logged.setdefault(record["step"], record["val_loss"]) == pytest.approx(record["val_loss"], abs=0)
    return logged


def _scores(directory: Path) -> dict[int, float | None]:
    store = LocalStore(directory, create=False)
    found = {}
    for step, location in store.checkpoints():
        score = store.read_manifest(location).score
        assert score is not None and (score["metric"], score["mode"], score["top"]) == ("val_loss", "min", 2)
        found[step] = score["value"]
    return found


def _committed(directory: Path) -> list[int]:
    events = [json.loads(line) for line in (directory / "events.jsonl").read_text().splitlines()]
    return sorted({e["step"] for e in events if e["event"] == "commit"}, reverse=True)


def _expected(directory: Path, logged: dict[int, float]) -> set[int]:
    return set(sorted(logged, key=lambda step: logged[step])[:2]) | set(_committed(directory)[:2])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lightning_best")
    _fit(root / "straight", root / "straight.pt")
    _fit(root / "killed", root / "killed.pt", 14)
    _fit(root / "killed", root / "killed.pt")
    return root


def test_the_newest_two_and_the_best_two_by_val_loss_are_kept(runs: Path) -> None:
    logged = _evaluations(runs / "straight.pt")
    assert sorted(logged) == [6, 12, 18, 24, 30]
    assert sorted(logged, key=lambda step: logged[step])[:2] == [18, 6]  # the noise puts the newest behind
    scores = _scores(runs / "straight")
    assert set(scores) == _expected(runs / "straight", logged)
    assert all(value == logged.get(step) for step, value in scores.items())


def test_a_sigkill_and_a_resume_keep_the_same_set(runs: Path) -> None:
    assert _scores(runs / "killed") == _scores(runs / "straight")
    assert_state_equal(torch.load(runs / "killed.pt"), torch.load(runs / "straight.pt"))


def test_restore_best_restores_the_best_bit_for_bit(runs: Path) -> None:
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    holder = nn.Module()
    holder.net = net  # the LightningModule's keys: net.0.weight, ...
    with cf.Checkpointer(runs / "killed", model=holder, rng=False) as ckpt:
        assert ckpt.restore(step="best") == 18
    assert_state_equal(holder.state_dict(), torch.load(runs / "killed.pt.models" / "18.pt"))


def test_a_fit_goes_back_to_the_best_and_on_from_it_exactly(runs: Path, tmp_path: Path) -> None:
    """``resume="best"`` over a copy of the straight run: the fit restores step 18 (the best by
    ``val_loss``), sets aside the newer ones (of the course it left), and trains epochs 4 and 5
    again: it ends bit-identical to the straight run, with the same checkpoints kept."""
    shutil.copytree(runs / "straight", tmp_path / "run")
    _fit(tmp_path / "run", tmp_path / "run.pt", 0, "0", "best")
    assert (tmp_path / "run.pt.restored").read_text() == "18"
    assert_state_equal(torch.load(tmp_path / "run.pt"), torch.load(runs / "straight.pt"))
    assert _scores(tmp_path / "run") == _scores(runs / "straight")
    aside = LocalStore(tmp_path / "run", create=False).set_aside_checkpoints()
    newer = sorted(step for step in _scores(runs / "straight") if step > 18)
    assert newer and sorted((a.step, a.kind) for a in aside) == [(step, Aside.ABANDONED) for step in newer]
    with pytest.raises(cf.errors.InvalidArgumentError, match="resume takes True, False or 'best'"):
        CheckFreqCallback("unused", monitor="val_loss", save_top_k=1, resume="newest")
    with pytest.raises(cf.errors.InvalidArgumentError, match="needs monitor= and save_top_k="):
        CheckFreqCallback("unused", resume="best")


def test_a_validation_mid_epoch_scores_the_checkpoint_of_its_step(tmp_path: Path) -> None:
    _fit(tmp_path / "run", tmp_path / "run.pt", 0, "3")
    logged = _evaluations(tmp_path / "run.pt")
    assert sorted(logged) == [3, 6, 9, 12, 15, 18, 21, 24, 27, 30]
    scores = _scores(tmp_path / "run")
    assert set(scores) == _expected(tmp_path / "run", logged)
    assert all(value == logged.get(step) for step, value in scores.items())


def test_the_options_are_checked() -> None:
    with pytest.raises(cf.errors.InvalidArgumentError, match="save_top_k=2 keeps the best by a metric"):
        CheckFreqCallback("unused", save_top_k=2)
    with pytest.raises(cf.errors.InvalidArgumentError, match="mode must be 'min' or 'max'"):
        CheckFreqCallback("unused", monitor="val_loss", mode="lowest", save_top_k=1)
    with pytest.raises(cf.errors.InvalidArgumentError, match="already keeps the best"):
        CheckFreqCallback("unused", monitor="val_loss", save_top_k=1, keep=cf.Retention(2, best=("acc", "max")))
