"""A resumed session under the default policy: what the checkpoint carries, and what it costs after a real SIGKILL.

The killed run is a real process SIGKILLed mid-run (``scripts/killed_session.py``); the resumed
sessions restore copies of its directory and are measured against no-checkpoint runs of the same
loop with the rule of ``scripts/overhead_loop.py`` (the one ``test_overhead_real.py`` uses).
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from overhead_loop import Sessions, judge, resumed_sessions, setup

from checkfreq import Checkpointer
from checkfreq.pipeline.restore import read_checkpoint
from checkfreq.policies import Auto, ConvergenceAware, Every, Overhead, YoungDaly
from checkfreq.run.events import read_events
from helpers import SCRIPTS, finish_job, launch_job, make_model, train_step

P = 0.035  # Auto's bound


def _run(directory: Path, policy, steps: int, *, losses: bool = False, settle: bool = False) -> Checkpointer:  # type: ignore[no-untyped-def]
    """Restore and train ``steps`` steps; ``settle``: then let the persist in flight end and the policy see it."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(directory, policy=policy, keep=2, model=model, optimizer=opt)
    ckpt.restore()
    for i in range(steps + 5 * settle):
        if i == steps:
            ckpt.wait()
        loss = train_step(model, opt)
        ckpt.step(loss=loss if losses else None)
    return ckpt


POLICIES = {
    "Overhead": lambda: Overhead(p=0.2),
    "Auto": Auto,
    "YoungDaly": lambda: YoungDaly(mtbf=0.2),
    "ConvergenceAware": lambda: ConvergenceAware(mtbf=0.2, horizon=2.0, refit_every=16),
    "Every(seconds)": lambda: Every(seconds=0.005),
}


@pytest.mark.parametrize("name", POLICIES)
def test_the_checkpoint_carries_the_profile_and_the_policy_state_into_the_next_session(
    tmp_path: Path, name: str
) -> None:
    first = _run(tmp_path, POLICIES[name](), 80, losses=True, settle=True)
    first.save(blocking=True)
    first.close()
    manifest, _ = read_checkpoint(sorted(tmp_path.glob("step_*"))[-1])
    carried = manifest.state["checkfreq"]
    assert carried["policy"]["type"] == type(first.policy).__name__
    assert carried["profile"]["iteration"] > 0 and carried["profile"]["stall"] > 0

    resumed = _run(tmp_path, POLICIES[name](), 0)
    assert resumed.policy.state_dict() == carried["policy"]["state"]  # type: ignore[attr-defined]
    assert resumed.profiler.state_dict() == carried["profile"]
    assert name == "Every(seconds)" or resumed.policy.interval > 0  # type: ignore[attr-defined]  # learned, and carried
    assert [e for e in read_events(tmp_path) if e["event"] == "restore"][-1]["seeded"] == ["profile", "policy"]
    resumed.close()


def test_inspect_shortens_the_carried_run_state(tmp_path: Path) -> None:
    """A convergence-aware policy carries its loss history: ``inspect`` prints its start, ``--json`` all of it."""
    from typer.testing import CliRunner

    from checkfreq.cli import app

    run = _run(tmp_path, POLICIES["ConvergenceAware"](), 300, losses=True)
    run.save(blocking=True)
    run.close()
    checkpoint = str(sorted(tmp_path.glob("step_*"))[-1])
    text = CliRunner().invoke(app, ["inspect", checkpoint], env={"COLUMNS": "400"}).output
    assert "characters;--jsonshowsall" in "".join(text.replace("│", "").split())  # however the table wraps it
    doc = json.loads(CliRunner().invoke(app, ["inspect", checkpoint, "--json"]).output)
    assert len(doc["objects"]["checkfreq"]["value"]["policy"]["state"]["losses"]) > 100


def test_a_state_saved_by_another_policy_or_configuration_is_left_out_loudly(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    _run(tmp_path, Overhead(p=0.2), 40).close()
    with caplog.at_level(logging.WARNING, logger="checkfreq"):
        other = _run(tmp_path, Overhead(p=0.1), 0)
    assert "not resuming the saved state of the Overhead policy" in caplog.text and "p': 0.2" in caplog.text
    assert other.policy.interval == 0 and other.profiler.iteration.value > 0  # type: ignore[attr-defined]
    other.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="checkfreq"):
        _run(tmp_path, YoungDaly(mtbf=60.0), 0).close()
    assert "saved by policy 'Overhead', this run uses YoungDaly" in caplog.text


def test_a_resumed_session_profiles_before_its_first_checkpoint(tmp_path: Path) -> None:
    """Restored at step 30 with no plan and no checkpoint cost measured: the session waits and measures."""
    first = _run(tmp_path, Every(1000), 30)
    first.save(blocking=True)
    first.close()
    resumed = _run(tmp_path, Overhead(p=0.2), 60)
    snapshots = [e for e in read_events(tmp_path) if e["event"] == "snapshot" and e["step"] > 30]
    resumed.close()
    assert snapshots and snapshots[0]["step"] >= 40, snapshots  # this session's warmup
    assert all(e["clean_iterations"] > 0 for e in snapshots), snapshots  # never back to back


def _assert_rate_and_bound(runs: Sessions, killed_run: list[int]) -> None:
    """The session profiles first; its checkpoints per step within a factor 2 of an uninterrupted
    run's over the same steps; its overhead within the bound, or within what the uninterrupted
    runs spent over the same steps, plus noise.

    Uninterrupted runs of the same job differ among themselves here (each plans from its own noisy
    measurements, more so under DDP on two shared cores): both rules take the measurement's
    resolution into account, as the range the uninterrupted runs span. The bound is a whole-run
    promise (``test_overhead_real``); over a 120-step window in the middle of a run, on a quiet CI
    machine, uninterrupted runs measured 4.5 % against 3.5 % (docs/policies.md), so a resumed
    session is held to the higher of the bound and the costliest uninterrupted run. Measured here
    over 18 pairs, a resumed session spent 0.8 points more than the uninterrupted run beside it,
    with a standard deviation of 3.7 points; the no-checkpoint runs' spread alone (``noise``) is
    often under 1 point, too fine to compare two checkpointing runs with.
    """
    overhead, noise = judge(runs.resumed, runs.bases)
    fresh = max(t / b for t, b in zip(runs.uninterrupted, runs.bases, strict=True)) - 1
    resumed = [len(c) for c in runs.resumed_checkpoints]
    uninterrupted = [len(c) for c in runs.uninterrupted_checkpoints]
    detail = (
        f"killed run {killed_run}; restored {runs.restored_steps}; resumed {runs.resumed_checkpoints}; "
        f"uninterrupted {runs.uninterrupted_checkpoints}; times {runs.resumed}, bases {runs.bases}; "
        f"{runs.reasons[-1]}"
    )
    assert all(step > 0 for step in runs.restored_steps), detail
    # the session's warmup
    assert all(c[0] - r >= 10 for c, r in zip(runs.resumed_checkpoints, runs.restored_steps, strict=True) if c), detail
    assert min(uninterrupted) / 2 <= statistics.mean(resumed) <= 2 * max(uninterrupted), detail
    assert overhead <= max(P, fresh) + noise, (
        f"resumed sessions: median overhead {overhead:.1%} > both the bound {P:.1%} and the costliest uninterrupted "
        f"run's {fresh:.1%}, + noise {noise:.1%}; {detail}"
    )


@pytest.mark.slow
def test_resumed_session_after_sigkill_keeps_the_rate_and_the_bound(tmp_path: Path) -> None:
    killed = tmp_path / "killed"
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "killed_session.py"), str(killed), "--kill-at", "120"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr[-3000:]
    torch.set_num_threads(1)
    model, opt, x, y = setup()
    runs = resumed_sessions(killed, tmp_path, reps=3, steps=120, model=model, opt=opt, x=x, y=y)
    _assert_rate_and_bound(runs, [json.loads(line)["checkpoint"] for line in proc.stdout.splitlines()])


@pytest.mark.slow
def test_torchrun_restart_keeps_the_rate_and_the_bound_and_ranks_agree(tmp_path: Path) -> None:
    out = finish_job(
        launch_job(tmp_path, "ddp_sessions.py", str(tmp_path), "--kill-at", "120", "--reps", "3", "--steps", "200")
    )
    records = [
        json.loads(line) for rank in (0, 1) for line in (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()
    ]
    sessions = {r["rank"]: Sessions(**r["sessions"]) for r in records if r["life"] == 1 and "sessions" in r}
    assert set(sessions) == {0, 1}, out[-3000:]
    assert sessions[0].resumed_checkpoints == sessions[1].resumed_checkpoints  # every rank agrees after restore
    killed_run = [r["checkpoint"] for r in records if r["life"] == 0 and r["rank"] == 0 and "checkpoint" in r]
    _assert_rate_and_bound(sessions[0], killed_run)


@pytest.mark.slow
def test_under_torchrun_every_policy_is_seeded_and_the_ranks_agree_after_the_restore(tmp_path: Path) -> None:
    """Each policy trains a session under 2-rank DDP, closes, and a second session restores it: both
    ranks restore the same step, are seeded with their profile and policy, profile (all but the time
    cadence) before the first checkpoint of the resumed session, and checkpoint at the same steps. Each closed
    Checkpointer leaves no process group behind."""
    files = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    finish_job(launch_job(tmp_path, "ddp_policies.py", str(tmp_path), "--steps", "400", restarts=0))
    ranks = [json.loads(f.read_text()) for f in files]
    for rank in ranks:  # ten Checkpointers created and closed: each destroyed the groups it made
        before, after = rank.pop("groups")
        assert after == before, (before, after)
    assert set(ranks[0]) == {"Overhead", "Auto", "YoungDaly", "ConvergenceAware", "Every(seconds)"}
    for name, result in ranks[0].items():
        first, resumed = result["first"], result["resumed"]
        assert ranks[1][name] == result, (name, result, ranks[1][name])
        assert first["taken"] and resumed["restored"] == first["taken"][-1], (name, result)
        assert result["seeded"] == ["profile", "policy"], (name, result)
        assert resumed["taken"], (name, result)
        if name != "Every(seconds)":  # a time cadence has no warm-up: how many steps fill 0.2 s depends on the machine
            assert resumed["taken"][0] - resumed["restored"] >= 10, (name, result)
