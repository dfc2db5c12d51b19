"""Keep-best retention with the plain loop (scripts/best_loop.py): ``Retention(2, best=("val_loss", "min"),
top=2)`` over a run whose validation loss is noisy keeps the two newest checkpoints and the two whose
logged ``val_loss`` is lowest; a SIGKILL and a resume keep the same set; ``restore(step="best")`` restores
the best bit for bit; ``checkfreq ls`` marks them and ``checkfreq export --best`` exports it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import checkfreq as cf
from checkfreq.cli import app
from checkfreq.storage.format import Manifest, checkpoint_step
from helpers import DOCS, SCRIPTS, assert_state_equal, docs_example


def _run(directory: Path, out: Path, kill_step: int = 0) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "best_loop.py"), str(directory), str(kill_step), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == (-signal.SIGKILL if kill_step else 0), proc.stderr[-3000:]


def _evaluations(out: Path) -> dict[int, float]:
    """step → val_loss, as the run logged them (a resumed run logs its epochs again, with the same values)."""
    logged: dict[int, float] = {}
    for line in Path(f"{out}.evals").read_text().splitlines():
        record = json.loads(line)
        assert logged.setdefault(record["step"], record["val_loss"]) == record["val_loss"]
    return logged


def _listed(directory: Path) -> dict[int, float | None]:
    """step → the score its manifest records, of every checkpoint the run keeps."""
    found = {}
    for path in sorted(p for p in directory.glob("step_*") if checkpoint_step(p.name) is not None):
        manifest = Manifest.from_json((path / "manifest.json").read_bytes())
        assert manifest.score is not None and manifest.score["metric"] == "val_loss"
        found[manifest.step] = manifest.score["value"]
    return found


def _committed(directory: Path) -> list[int]:
    """Every step the run committed (its event log), newest first."""
    events = [json.loads(line) for line in (directory / "events.jsonl").read_text().splitlines()]
    return sorted({e["step"] for e in events if e["event"] == "commit"}, reverse=True)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One run straight through, and one SIGKILLed at step 20 (mid-epoch 4) then resumed."""
    root = tmp_path_factory.mktemp("best")
    _run(root / "straight", root / "straight.pt")
    _run(root / "killed", root / "killed.pt", kill_step=20)
    killed_listing = _listed(root / "killed")
    _run(root / "killed", root / "killed.pt")
    (root / "killed.listing").write_text(json.dumps(killed_listing))
    return {"root": root}


def test_the_kept_set_is_the_newest_two_and_the_best_two_by_the_logged_val_loss(runs: dict[str, Path]) -> None:
    root = runs["root"]
    logged = _evaluations(root / "straight.pt")
    assert len(logged) == 6
    best_two = sorted(logged, key=lambda step: logged[step])[:2]
    assert best_two != sorted(logged)[-2:], "the noise must make the best other than the newest"
    listed = _listed(root / "straight")
    assert set(listed) == set(best_two) | set(_committed(root / "straight")[:2])
    for step, value in listed.items():  # a checkpoint's score is the value logged at its step, or none
        assert value == logged.get(step)
    assert len(_committed(root / "straight")) > len(listed) + 4  # retention did delete the others


def test_a_sigkill_and_a_resume_keep_the_same_set(runs: dict[str, Path]) -> None:
    root = runs["root"]
    before = {int(s): v for s, v in json.loads((root / "killed.listing").read_text()).items()}
    logged = _evaluations(root / "killed.pt")
    scored = {s: v for s, v in before.items() if v is not None}
    assert scored and all(logged[s] == v for s, v in scored.items())  # the scores the killed run logged
    kept = set(sorted(before)[-2:]) | set(sorted(scored, key=lambda s: scored[s])[:2])
    # all of them are there; a kill between a commit and its retention leaves the one that retention would delete
    assert kept <= set(before) and len(set(before) - kept) <= 1, before
    assert _listed(root / "killed") == _listed(root / "straight")
    assert _evaluations(root / "killed.pt") == _evaluations(root / "straight.pt")
    assert_state_equal(torch.load(root / "killed.pt"), torch.load(root / "straight.pt"))


def test_restore_best_restores_the_best_bit_for_bit(runs: dict[str, Path]) -> None:
    root = runs["root"]
    logged = _evaluations(root / "killed.pt")
    best = min(logged, key=lambda step: logged[step])
    model = _model()
    with cf.Checkpointer(root / "killed", model=model, rng=False) as ckpt:  # no Retention(best=): the manifests say
        assert ckpt.restore(step="best") == best
    assert_state_equal(model.state_dict(), torch.load(f"{root / 'killed.pt'}.models/{best}.pt"))
    model = _model()
    keep = cf.Retention(1, best=("val_loss", "max"))  # the Checkpointer's own rule ranks: the worst logged
    with cf.Checkpointer(root / "killed", model=model, rng=False, keep=keep) as ckpt:
        assert ckpt.restore(step="best") == max(set(logged) & set(_listed(root / "killed")), key=lambda s: logged[s])


def _cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def test_checkfreq_ls_marks_the_best_and_export_best_exports_it(runs: dict[str, Path]) -> None:
    root = runs["root"]
    logged = _evaluations(root / "straight.pt")
    ranked = sorted(logged, key=lambda step: logged[step])
    rows = {row["step"]: row for row in json.loads(_cli("ls", str(root / "straight"), "--json"))}
    assert {s for s, row in rows.items() if row["best"] is not None} == set(ranked[:2])
    assert rows[ranked[0]]["best"] == {"metric": "val_loss", "mode": "min", "value": logged[ranked[0]], "rank": 1}
    assert all(row["score"] is None for s, row in rows.items() if s not in logged)
    table = _cli("ls", str(root / "straight"))
    assert f"best 1 of 2 by val_loss (min): {logged[ranked[0]]:.6g}" in table
    assert f"best 2 of 2 by val_loss (min): {logged[ranked[1]]:.6g}" in table
    assert f'ckpt.restore(step=N), N a valid step above; ckpt.restore(step="best") takes step {ranked[0]}' in table
    target = root / "best.safetensors"
    out = _cli("export", str(root / "straight"), "--best", "--to", str(target), "--only", "model")
    assert f"of step {ranked[0]}" in out
    from safetensors.torch import load_file

    exported = load_file(str(target))
    reference = torch.load(f"{root / 'straight.pt'}.models/{ranked[0]}.pt")
    assert_state_equal(exported, reference)


def test_restore_best_without_any_score_says_why(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with cf.Checkpointer(tmp_path, policy=1, model=model) as ckpt:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            ckpt.step()
    with (
        cf.Checkpointer(tmp_path, model=_model()) as ckpt,
        pytest.raises(cf.errors.NoValidCheckpointError, match="none of the 3 checkpoints"),
    ):
        ckpt.restore(step="best")
    with cf.Checkpointer(tmp_path / "fresh", model=_model()) as ckpt:
        assert ckpt.restore(step="best") == 0  # nothing listed: a fresh run
    with (
        cf.Checkpointer(tmp_path / "fresh", model=_model()) as ckpt,
        pytest.raises(cf.errors.InvalidArgumentError, match="'newest'"),
    ):
        ckpt.restore(step="newest")


def test_the_docs_example_keeps_the_best_and_restores_it(tmp_path: Path) -> None:
    """docs/storage.md, "Keeping the best", as written: run twice (the second resumes at the end), it prints
    the step that ``checkfreq ls`` marks best, the lowest val_loss the manifests record."""
    (tmp_path / "example.py").write_text(docs_example(DOCS / "storage.md", "Keeping the best"))
    for _ in range(2):
        proc = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(_cli("ls", str(tmp_path / "runs" / "best"), "--json"))
    scored = {row["step"]: row["score"] for row in rows if row["score"] is not None}
    assert len(scored) >= 2 and {row["step"] for row in rows if row["best"]} == set(sorted(scored, key=scored.get)[:2])
    assert proc.stdout.split() == [str(min(scored, key=scored.get))]
