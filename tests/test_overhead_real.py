"""``Overhead(p)`` on a real small CPU training loop with real checkpoints.

Overhead is measured as a ratio of wall time (what the bound promises) against a no-checkpoint
run of the same loop in the same test, interleaved (A B A B …) and repeated; the median ratio is
compared with ``p`` plus the measurement's own resolution here: the spread of the
no-checkpoint runs (other jobs on these shared machines move iteration times by tens of percent;
on a quiet machine the margin shrinks to almost nothing).

Timing starts after the first checkpoint (the one that measures what checkpoints cost): a
test-sized run of a few seconds cannot amortise that one-off, which a real run of minutes does.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest
import torch

from checkfreq import storage
from checkfreq.checkpointer import Checkpointer
from checkfreq.policies import Overhead

STEPS = 200
WARMUP = 15  # Overhead takes its profiling checkpoint at step 10


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt, torch.randn(256, 256), torch.randn(256, 256)


def _train(steps: int, ckpt: Checkpointer | None, model, opt, x, y, warmup: int = 0) -> float:  # type: ignore[no-untyped-def]
    """Wall seconds for ``steps`` steps after ``warmup`` untimed ones, including the wait for the last persist."""
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if ckpt is not None:
            ckpt.step()
    if ckpt is not None:
        ckpt.close()
    return time.perf_counter() - start


@pytest.mark.slow
def test_whole_run_overhead_stays_within_the_bound(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    model, opt, x, y = _setup()
    _train(30, None, model, opt, x, y)  # warm up the allocator and kernels
    bounds = (0.02, 0.05)
    ratios: dict[float, list[float]] = {p: [] for p in bounds}
    policies: dict[float, list[Overhead]] = {p: [] for p in bounds}
    bases: list[float] = []
    for rep in range(5):  # interleaved: base, p=0.02, p=0.05, base, …
        bases.append(_train(STEPS, None, model, opt, x, y, WARMUP))
        for p in bounds:
            policy = Overhead(p=p)
            ckpt = Checkpointer(tmp_path / f"p{p}-{rep}", policy=policy, keep=2, model=model, optimizer=opt)
            ratios[p].append(_train(STEPS, ckpt, model, opt, x, y, WARMUP) / bases[-1])
            policies[p].append(policy)
    # The resolution of this measurement: how much the same no-checkpoint run varies here.
    noise = (max(bases) - min(bases)) / statistics.median(bases)
    for p in bounds:
        assert all(pol.interval > 0 for pol in policies[p]), "no checkpoint was planned"
        overhead = statistics.median(ratios[p]) - 1
        assert overhead <= p + noise, (
            f"p={p}: median overhead {overhead:.1%} > bound + measurement noise {noise:.1%}; "
            f"ratios {ratios[p]}; {policies[p][-1].reason}"
        )


@pytest.mark.slow
def test_interval_grows_when_persist_slows_and_shrinks_when_it_recovers(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    model, opt, x, y = _setup()
    delay = {"seconds": 0.0}
    write = storage.write_data

    def slow_write(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(delay["seconds"])
        return write(*args, **kwargs)

    monkeypatch.setattr(storage, "write_data", slow_write)
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
    iteration = ckpt.profiler.iteration.value
    delay["seconds"] = 150 * iteration  # persist now takes at least 150 iterations
    during = run(500)
    delay["seconds"] = 0.0
    after = run(500)
    for _ in range(35):  # a long plan sees its first fast persists only after `during` more steps
        if after < during:
            break
        after = run(100)
    ckpt.close()
    assert during > before and during >= 75, policy.reason  # at least half the injected delay, in steps
    assert after < during, policy.reason
