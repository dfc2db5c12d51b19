"""``Overhead(p)`` on a real small CPU training loop with real checkpoints.

Overhead is measured and judged as ``scripts/overhead_loop.py`` says: a ratio of wall time (what
the bound promises) against a no-checkpoint run of the same loop in the same test, interleaved
(A B A B …) and repeated, within ``p`` plus the spread of the no-checkpoint runs.

Timing starts after the first checkpoint (the one that measures what checkpoints cost): a
test-sized run of a few seconds cannot amortise that one-off, which a real run of minutes does.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from overhead_loop import judge, setup, train  # tests/scripts, on the path through conftest

from checkfreq.checkpointer import Checkpointer
from checkfreq.pipeline.save import commit
from checkfreq.policies import Overhead
from checkfreq.tools.report import load_run

STEPS = 200
WARMUP = 15  # Overhead takes its profiling checkpoint at step 10


@pytest.mark.slow
def test_whole_run_overhead_stays_within_the_bound(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    model, opt, x, y = setup()
    train(30, None, model, opt, x, y)  # warm up the allocator and kernels
    bounds = (0.02, 0.05)
    timed: dict[float, list[float]] = {p: [] for p in bounds}
    policies: dict[float, list[Overhead]] = {p: [] for p in bounds}
    bases: list[float] = []
    for rep in range(5):  # interleaved: base, p=0.02, base, p=0.05, base, …: each run between two bases
        for p in bounds:
            bases.append(train(STEPS, None, model, opt, x, y, WARMUP))
            policy = Overhead(p=p)
            ckpt = Checkpointer(tmp_path / f"p{p}-{rep}", policy=policy, keep=2, model=model, optimizer=opt)
            timed[p].append(train(STEPS, ckpt, model, opt, x, y, WARMUP))
            policies[p].append(policy)
    bases.append(train(STEPS, None, model, opt, x, y, WARMUP))
    for i, p in enumerate(bounds):
        assert all(pol.interval > 0 for pol in policies[p]), "no checkpoint was planned"
        overhead, noise = judge(timed[p], bases[i:-1:2], bases[i + 1 :: 2])
        assert overhead <= p + noise, (
            f"p={p}: median overhead {overhead:.1%} > bound + measurement noise {noise:.1%}; "
            f"times {timed[p]}, bases {bases}; {policies[p][-1].reason}"
        )


@pytest.mark.slow
def test_interval_grows_when_persist_slows_and_shrinks_when_it_recovers(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    model, opt, x, y = setup()
    delay = {"iterations": 0}
    write = commit.write_data

    def slow_write(*args, **kwargs):  # type: ignore[no-untyped-def]
        # in today's iterations: a busier machine slows both
        time.sleep(delay["iterations"] * ckpt.profiler.iteration.value)
        return write(*args, **kwargs)

    monkeypatch.setattr(commit, "write_data", slow_write)  # where the commit protocol writes each rank's file
    policy = Overhead(p=0.05)
    ckpt = Checkpointer(tmp_path, policy=policy, keep=2, model=model, optimizer=opt)

    def run(steps: int) -> int:
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt.step()
        return policy.interval

    before = run(200)
    delay["iterations"] = 150  # persist now takes at least 150 iterations
    during = run(500)
    delay["iterations"] = 0
    after = run(500)
    for _ in range(35):  # a long plan sees its first fast persists only after `during` more steps
        if after < during:
            break
        after = run(100)
    ckpt.close()
    assert during > before and during >= 75, policy.reason  # at least half the injected delay, in steps
    assert after < during, policy.reason


def _evaluating_loop(directory: Path, evaluation: float) -> tuple[int, float, float]:
    """400 steps under ``Overhead(p=0.05)``, sleeping ``evaluation`` seconds every 40 (other work
    between steps): (checkpoints taken, seconds slept, the profiler's ``away``)."""
    model, opt, x, y = setup()
    ckpt = Checkpointer(directory, policy=Overhead(p=0.05), keep=2, model=model, optimizer=opt)
    taken, slept = 0, 0.0
    for i in range(1, 401):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        taken += ckpt.step()
        if i % 40 == 0 and evaluation:
            time.sleep(evaluation)
            slept += evaluation
    away = ckpt.profiler.away
    ckpt.close()
    return taken, slept, away


def test_an_evaluation_between_steps_is_not_counted_as_checkpointing(tmp_path: Path) -> None:
    """A loop that spends 0.1 s on other work (an evaluation) every 40 steps, about as long as its
    training: the profiler tells that time apart from training and checkpointing (``away``),
    whether or not a persist ran meanwhile, so the policy's budget and windows do not read it as
    the checkpoints' cost, and it checkpoints about as often as the same loop without it (counted
    as overhead, the evaluations left it 5 or 6 checkpoints against 20 to 60); the event log
    carries it (``away_s``) and ``checkfreq report`` leaves it out of the overhead."""
    torch.set_num_threads(1)
    plain, _, _ = _evaluating_loop(tmp_path / "plain", 0.0)
    taken, slept, away = _evaluating_loop(tmp_path / "evaluating", 0.1)
    assert 0.7 * slept <= away <= slept + 0.5, (away, slept)
    # counted as overhead the evaluations leave it 5 or 6; two timing-driven runs on a shared machine
    # differ by more than a factor of 2 at times (9 against 19 in a CI run), hence the floor of 8
    assert taken >= min(plain / 2, 8), (taken, plain)
    report = load_run(tmp_path / "evaluating")  # checkfreq report: the windows' other work set aside too
    logged = sum(r.away_s for r in report.records)
    assert 0.7 * slept <= logged <= away + 1e-9, (logged, away)
    assert report.summary is not None and report.summary.overhead is not None
    assert report.summary.overhead < 0.25, report.summary  # counted, the sleeps alone read as about half
