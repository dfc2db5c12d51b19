"""GPU mode of ``benchmarks.run``: device-to-host snapshot into pinned buffers vs the measured pinned-copy bandwidth.

Runs only where CUDA is available; elsewhere it reports why it skipped. The state lives on the
GPU; checkfreq's snapshot copies it on a side stream into its reused pinned host buffer, so the
``save()`` call returns before the copy ends and the stall is the call itself.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

import checkfreq as cf
from benchmarks import analysis as an
from benchmarks.baselines import DcpAsyncThread, TorchSave
from benchmarks.checkfreq_methods import NEVER
from benchmarks.methods import Method, Sample, unlink
from benchmarks.state_bench import interleave
from benchmarks.states import State, build_state

PINNED = "pinned copy_ device→host (limit)"
SNAPSHOT = "checkfreq snapshot (GPU)"


class PinnedCopy(Method):
    """Every tensor ``copy_``'d into a preallocated pinned buffer with ``non_blocking``, then synchronised."""

    name = PINNED
    kind = "limit"

    def setup(self, state: State, workdir: Path) -> None:
        self._pairs = [(torch.empty(t.shape, dtype=t.dtype, pin_memory=True), t) for t in state.tensors.values()]

    def run(self) -> Sample:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for dst, src in self._pairs:
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return Sample(stall=time.perf_counter() - start)


class CheckfreqGpuSave(Method):
    """``ckpt.save()``: the stall is the call; the copy time is until the side stream finishes."""

    name = SNAPSHOT
    kind = "checkfreq"

    def setup(self, state: State, workdir: Path) -> None:
        self._state = state
        self._ckpt = cf.Checkpointer(
            workdir / "gpu", model=state.model, optimizer=state.optimizer, policy=NEVER, keep=10**9
        )

    def run(self) -> Sample:
        self._state.optimizer.step()  # no gradients: changes nothing; step() follows an optimizer step, as in training
        self._ckpt.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        self._ckpt.save()
        self._state.optimizer.step()  # no gradients: only the fence, ordered on the stream
        stall = time.perf_counter() - start
        torch.cuda.synchronize()
        copied = time.perf_counter() - start
        self._ckpt.wait()
        durable = time.perf_counter() - start
        for path in self._ckpt.directory.glob("step_*"):
            unlink(path)
        # ``write`` here holds the device-to-host copy time, for the bandwidth ratio
        return Sample(stall=stall, durable=durable, write=copied)

    def close(self) -> None:
        self._ckpt.close()


def bench_gpu(megabytes: float, repeats: int) -> dict[str, Any]:
    """Interleaved GPU measurements, or ``{"skipped": reason}`` without CUDA."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device in this environment"}
    state = build_state(megabytes, device="cuda")
    methods: list[Method] = [
        PinnedCopy(),
        CheckfreqGpuSave(),
        TorchSave(),
        DcpAsyncThread(async_staging=False, fresh_stager=True),
        DcpAsyncThread(async_staging=True, fresh_stager=True),
    ]
    result = {"nbytes": state.nbytes, "device": torch.cuda.get_device_name(), **interleave(methods, state, repeats)}
    pinned = an.field(result, PINNED, "stall")
    stall = an.field(result, SNAPSHOT, "stall")
    ratios = {
        "snapshot D2H bandwidth ÷ pinned copy_ bandwidth (target ≥ 0.8)": an.per_round(
            pinned, an.field(result, SNAPSHOT, "write")
        ),
        "torch.save+fsync stall ÷ checkfreq stall": an.per_round(an.field(result, TorchSave.name, "stall"), stall),
    }
    best = an.dcp_async_best(result)
    if best:
        ratios[f"{best} stall ÷ checkfreq stall"] = an.per_round(an.field(result, best, "stall"), stall)
    times = {f"{name}: stall": an.field(result, name, "stall") for name in result["samples"]}
    times[f"{SNAPSHOT}: device→host copy done"] = an.field(result, SNAPSHOT, "write")
    times[f"{SNAPSHOT}: durable"] = an.field(result, SNAPSHOT, "durable")
    return {
        "device": result["device"],
        "nbytes": state.nbytes,
        "seconds": times,
        "ratios": ratios,
        "errors": result["errors"],
    }
