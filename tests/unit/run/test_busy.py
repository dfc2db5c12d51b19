"""The busy-storage rule: a fixed interval shorter than the persist waits for it, as documented, and
says so once with the figures; every wait is an event, so no stall for storage goes unnoticed."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch

import checkfreq as cf
from checkfreq.policies.profiler import Profiler
from checkfreq.run.busy import MEMORY, PERSIST, busy_advice
from checkfreq.run.events import read_events
from checkfreq.storage.local import LocalStore
from checkfreq.tools.report import load_run, summary_text
from helpers import train_step

RATE = 32e6
"""Bytes per second the throttled store writes: a slow disk (or a busy network file system)."""


class ThrottledStore(LocalStore):
    """A local directory whose writes go no faster than :data:`RATE` (real files, fsynced)."""

    def write_file(self, staging: Path, name: str, chunks: Iterable[bytes | memoryview]) -> None:
        super().write_file(staging, name, _throttled(chunks))


def _throttled(chunks: Iterable[bytes | memoryview]) -> Iterator[bytes | memoryview]:
    start, sent = time.perf_counter(), 0
    for chunk in chunks:
        for at in range(0, len(chunk), 1 << 20):
            piece = chunk[at : at + (1 << 20)]
            yield piece
            sent += len(piece)
            time.sleep(max(0.0, start + sent / RATE - time.perf_counter()))


def test_a_fixed_interval_the_storage_cannot_keep_waits_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 3)
    )  # 12.6 MB with Adam's state: a persist of 0.4 s
    opt = torch.optim.Adam(model.parameters())
    stalls: dict[int, float] = {}
    caplog.set_level(logging.WARNING, logger="checkfreq.busy")
    with cf.Checkpointer(ThrottledStore(tmp_path), policy=2, model=model, optimizer=opt) as ckpt:
        for _ in range(8):
            train_step(model, opt)
            start = time.perf_counter()
            ckpt.step()
            stalls[ckpt.global_step] = time.perf_counter() - start
    events = read_events(tmp_path)
    persist = min(e["persist_s"] for e in events if e["event"] == "commit")
    assert persist > 0.2, "the throttle makes a persist far longer than a step"
    snapshots = sorted(e["step"] for e in events if e["event"] == "snapshot" and e["reason"] == "policy")
    assert snapshots == [2, 4, 6, 8], "the documented behaviour: checkpoints at the steps asked"
    waits = {e["step"]: e for e in events if e["event"] == "busy"}
    for step, stall in stalls.items():  # every long step() is explained by a busy event of its step
        if stall > persist / 4:
            assert step in waits and waits[step]["wait_s"] > stall / 2, (step, stall, waits)
    assert set(waits) >= {4, 6, 8}
    for e in waits.values():
        assert e["waiting_for"] == PERSIST and e["interval_steps"] == 2 and e["wait_s"] >= 0
    assert waits[8]["persist_s"] > 0.2 and waits[8]["bandwidth_gbps"] > 0

    text = summary_text(load_run(tmp_path))  # checkfreq report shows them too
    assert f"waited for busy storage (the previous persist or memory snapshot): {len(waits)} times" in text

    warnings = [r.getMessage() for r in caplog.records if r.name == "checkfreq.busy"]
    assert len(warnings) == 1, warnings  # once, however many waits
    assert "every 2 steps" in warnings[0] and "Training waited" in warnings[0]
    assert "a persist takes" in warnings[0] or "first persist is still running" in warnings[0]


def test_the_advice_gives_the_measured_figures_and_an_interval_that_fits() -> None:
    profiler = Profiler()
    for _ in range(3):
        profiler.record_iteration(0.22, persisting=False)
        profiler.record_persist(8.6, 12_470_000_000)
    text = busy_advice(PERSIST, profiler, 10, "It waits.")
    assert "every 10 steps, 2.20 s" in text and "a persist takes 8.60 s here (1.45 GB/s)" in text
    assert "at least 41 steps" in text and "It waits." in text
    assert "memory=True" in busy_advice(MEMORY, profiler, None, "It waits.")


def test_the_advice_says_a_slow_rate_in_a_unit_a_person_reads() -> None:
    profiler = Profiler()
    profiler.record_iteration(0.2, persisting=False)
    profiler.record_persist(0.1, 26_100)  # a small checkpoint: all fsync latency
    text = busy_advice(PERSIST, profiler, 5, "It waits.")
    assert "(261 kB/s)" in text and "GB/s" not in text


def test_the_advice_never_asks_for_an_interval_shorter_than_the_one_that_waited() -> None:
    profiler = Profiler()
    for _ in range(3):
        profiler.record_iteration(0.142, persisting=False)
        profiler.record_persist(0.1, 10_000_000)  # the usual persist fits 2 steps...
    text = busy_advice(PERSIST, profiler, 5, "It waits.", outlasted=0.9)  # ...but the previous one outlasted 5
    assert "every 5 steps, 0.71 s" in text and "a persist takes 0.10 s here" in text
    assert "the previous one took 0.90 s" in text and "at least 8 steps" in text


def test_a_retake_by_save_waits_without_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 1024), torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 3))
    opt = torch.optim.Adam(model.parameters())  # 12.6 MB with Adam's state: a persist of 0.4 s
    caplog.set_level(logging.WARNING, logger="checkfreq.busy")
    with cf.Checkpointer(ThrottledStore(tmp_path), policy=1000, model=model, optimizer=opt) as ckpt:
        train_step(model, opt)
        ckpt.step()
        ckpt.save()  # the policy decided none: the user's own checkpoints
        train_step(model, opt)
        ckpt.step()
        ckpt.save(blocking=True)  # the previous one is still being written
    waits = [e for e in read_events(tmp_path) if e["event"] == "busy"]
    assert [e["step"] for e in waits] == [2] and waits[0]["interval_steps"] is None, "the wait is still recorded"
    assert not [r for r in caplog.records if r.name == "checkfreq.busy"], "no interval of the user's waited"
