"""CheckFreqTrainer keeps the best checkpoint by ``metric_for_best_model`` and resumes from a checkfreq
checkpoint named by its path or as ``"best"``.

Each run is ``scripts/hf_train.py --noisy-eval`` (a tiny random GPT-2, 2 epochs of 6 optimizer steps, an
evaluation every 2 steps whose ``eval_noisy`` is its loss plus a noise drawn from the predictions, a
checkpoint every 3 steps, ``checkfreq_keep=2``) with ``--metric_for_best_model noisy --greater_is_better
false``: the Trainer's options become ``Retention(2, best=("eval_noisy", "min"))``.
Skipped when the ``transformers`` extra is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import checkfreq as cf
from checkfreq.storage.local import LocalStore
from helpers import SCRIPTS, assert_state_equal, hf_fit, run_job

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

BEST = ("--noisy-eval", "--metric_for_best_model", "noisy", "--greater_is_better", "false", "--eval_steps", "2")


def _scores(workdir: Path) -> dict[int, float | None]:
    store = LocalStore(workdir / "checkfreq", create=False)
    found = {}
    for step, location in store.checkpoints():
        score = store.read_manifest(location).score
        assert score is not None and (score["metric"], score["mode"], score["top"]) == ("eval_noisy", "min", 1)
        found[step] = score["value"]
    return found


def _evaluations(out: Path) -> dict[int, float]:
    return {e["step"]: e["eval_noisy"] for e in torch.load(out)["log_history"] if "eval_noisy" in e}


def _committed(workdir: Path) -> list[int]:
    events = [json.loads(line) for line in (workdir / "checkfreq" / "events.jsonl").read_text().splitlines()]
    return sorted({e["step"] for e in events if e["event"] == "commit"}, reverse=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run straight through (``reference``) and one SIGKILLed at step 7, then resumed (``run``)."""
    root = tmp_path_factory.mktemp("hf_best")
    (root / "reference").mkdir()
    (root / "run").mkdir()
    hf_fit(root / "reference", "final", *BEST)
    hf_fit(root / "run", "killed", *BEST, "--die-at", "7", killed=True)
    assert "restored 6 final 12" in hf_fit(root / "run", "final", *BEST)
    return root


def test_the_newest_two_and_the_best_by_metric_for_best_model_are_kept(runs: Path) -> None:
    logged = _evaluations(runs / "reference" / "final.pt")
    assert sorted(logged) == [2, 4, 6, 8, 10, 12]
    best = min(logged, key=lambda step: logged[step])
    assert best not in (10, 12), "the noise must make the best other than the newest"
    scores = _scores(runs / "reference")
    assert set(scores) == {best, *_committed(runs / "reference")[:2]}
    assert all(value == logged.get(step) for step, value in scores.items())


def test_a_sigkill_and_a_resume_keep_the_same_set(runs: Path) -> None:
    assert _scores(runs / "run") == _scores(runs / "reference")
    assert _evaluations(runs / "run" / "final.pt") == _evaluations(runs / "reference" / "final.pt")


def test_restore_best_restores_the_best_bit_for_bit(runs: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    logged = _evaluations(runs / "run" / "final.pt")
    best = min(logged, key=lambda step: logged[step])
    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=16, n_embd=64, n_layer=2, n_head=2))
    with cf.Checkpointer(runs / "run" / "checkfreq", model=model, rng=False) as ckpt:
        assert ckpt.restore(step="best") == best
    saved = [runs / "run" / f"{name}.pt.models" / f"{best}.pt" for name in ("killed", "final")]  # before, after
    assert_state_equal(model.state_dict(), torch.load(next(p for p in saved if p.is_file())))


def test_train_resumes_from_a_checkfreq_step_folder_or_the_best(runs: Path, tmp_path: Path) -> None:
    logged = _evaluations(runs / "reference" / "final.pt")
    best = min(logged, key=lambda step: logged[step])
    for name, resume in (("by_path", None), ("best", "best")):
        work = tmp_path / name
        work.mkdir()
        shutil.copytree(runs / "reference" / "checkfreq", work / "checkfreq")
        target = resume or str(work / "checkfreq" / f"step_{best}")  # unpadded, as a person types it
        out = hf_fit(work, "final", *BEST, "--resume_from_checkpoint", target)
        assert f"restored {best} final 12" in out
        assert_state_equal(torch.load(work / "final.pt")["model"], torch.load(runs / "reference" / "final.pt")["model"])
    elsewhere = runs / "reference" / "checkfreq" / f"step_{best:09d}"
    command = [
        sys.executable,
        str(SCRIPTS / "hf_train.py"),
        "--dir",
        str(tmp_path / "other"),
        "--out",
        str(tmp_path / "other.pt"),
        "--read-log",
        str(tmp_path / "other.log"),
        *BEST,
        "--resume_from_checkpoint",
        str(elsewhere),
    ]
    returncode, out = run_job(command, {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert returncode == 1
    assert "is a checkfreq checkpoint of" in out and f"pass checkfreq_dir='{elsewhere.parent}'" in out
