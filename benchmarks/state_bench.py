"""One state size, every method, interleaved: warm up each, then ``repeats`` rounds in rotating order."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.baselines import DcpAsyncProcess, DcpAsyncThread, DcpSave, SafetensorsSave, TorchSave
from benchmarks.checkfreq_methods import CheckfreqRestore, CheckfreqSave
from benchmarks.limits import RawCopy, RawRead, RawWrite
from benchmarks.methods import Method
from benchmarks.states import State, build_state

log = logging.getLogger("benchmarks.state")


def all_methods(quick: bool) -> list[Method]:
    """Every method, limits first. ``quick`` drops the cold-cache reads and DCP's process executor."""
    caches = (False,) if quick else (False, True)
    methods: list[Method] = [RawCopy(), RawWrite(), *[RawRead(cold=c) for c in caches]]
    methods += [
        TorchSave(),
        SafetensorsSave(),
        DcpSave(),
        DcpAsyncThread(async_staging=False),
        DcpAsyncThread(async_staging=True),
    ]
    if not quick:
        methods.append(DcpAsyncProcess())
    return methods + [CheckfreqSave(), *[CheckfreqRestore(cold=c) for c in caches]]


def bench_state(megabytes: float, repeats: int, quick: bool) -> dict[str, Any]:
    """Measure every method on a state of about ``megabytes`` MB; samples per method name."""
    state = build_state(megabytes)
    return {
        "megabytes": megabytes,
        "nbytes": state.nbytes,
        "tensors": len(state.tensors),
        **interleave(all_methods(quick), state, repeats),
    }


def interleave(methods: list[Method], state: State, repeats: int) -> dict[str, Any]:
    """Set up and warm up each method, then run ``repeats`` rounds, each in a rotated order."""
    samples: dict[str, list[dict[str, float]]] = {m.name: [] for m in methods}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="cf-bench-") as tmp:
        live: list[Method] = []
        for method in methods:
            try:
                method.setup(state, Path(tmp))
                method.run()  # warm-up, not recorded
                live.append(method)
            except Exception as e:  # noqa: BLE001 - a failing baseline is reported, not fatal
                log.warning("%s failed: %s", method.name, e)
                errors[method.name] = f"{type(e).__name__}: {e}"
        for round_ in range(repeats):
            shift = round_ % len(live) if live else 0
            for method in live[shift:] + live[:shift]:
                if method.name in errors:
                    continue
                gc.collect()
                os.sync()  # the previous method's writeback must not land on this one
                try:
                    samples[method.name].append(dataclasses.asdict(method.run()))
                except Exception as e:  # noqa: BLE001 - a baseline failing in a later round is reported too
                    log.warning("%s failed in round %d: %s", method.name, round_ + 1, e)
                    errors[method.name] = f"{type(e).__name__}: {e} (round {round_ + 1})"
                    samples[method.name] = []  # the rounds compare methods that ran in every one
        for method in live:
            method.close()
    return {"methods": [{"name": m.name, "kind": m.kind} for m in methods], "samples": samples, "errors": errors}
