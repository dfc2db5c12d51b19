"""checkfreq itself: a checkpoint's stall, time to durable and write bandwidth; restore into the live model."""

from __future__ import annotations

import time
from pathlib import Path

import checkfreq as cf
from benchmarks.limits import drop_cache, warm_cache
from benchmarks.methods import Method, Sample, unlink
from benchmarks.states import State

NEVER = cf.Every(n=10**12)


def shared_checkpointer(state: State, workdir: Path) -> cf.Checkpointer:
    """One Checkpointer (and one host buffer) per state, shared by the save and restore methods."""
    ckpt = getattr(state, "_checkpointer", None)
    if ckpt is None:
        ckpt = cf.Checkpointer(
            workdir / "checkfreq", model=state.model, optimizer=state.optimizer, policy=NEVER, keep=10**9
        )
        state._checkpointer = ckpt  # type: ignore[attr-defined]
    return ckpt


class CheckfreqSave(Method):
    """``ckpt.save()`` and the fence at the next ``optimizer.step()``, with no compute to overlap.

    The stall is therefore an upper bound: in a training loop the deferred copies overlap the
    next forward/backward pass. Older checkpoints are deleted before each run, outside timing
    (the newest stays, for the restore measurements).
    """

    name = "checkfreq"
    kind = "checkfreq"

    def setup(self, state: State, workdir: Path) -> None:
        self._state = state
        self._ckpt = shared_checkpointer(state, workdir)

    def run(self) -> Sample:
        for path in self._ckpt.directory.glob("step_*"):
            unlink(path)
        self._state.optimizer.step()  # no gradients: changes nothing; step() follows an optimizer step, as in training
        self._ckpt.step()  # a new step, so save() has something new to take
        start = time.perf_counter()
        self._ckpt.save()
        self._state.optimizer.step()  # no gradients: only the fence runs (the deferred copies)
        copied = time.perf_counter()
        self._ckpt.wait()
        durable = time.perf_counter()
        return Sample(stall=copied - start, durable=durable - start, write=durable - copied)

    def close(self) -> None:
        self._ckpt.close()


class CheckfreqRestore(Method):
    """``ckpt.restore()`` of the newest committed checkpoint into the existing model and optimizer.

    Hot: the data file is read once first, since checkfreq writes it with ``O_DIRECT`` and a
    just-written checkpoint is not in the page cache; cold: its pages are evicted first.
    """

    kind = "checkfreq"

    def __init__(self, cold: bool) -> None:
        self.cold = cold
        self.name = f"checkfreq restore ({'cold' if cold else 'hot'} cache)"

    def setup(self, state: State, workdir: Path) -> None:
        self._ckpt = shared_checkpointer(state, workdir)
        if not any(self._ckpt.directory.glob("step_*")):
            state.optimizer.step()  # no gradients: changes nothing; step() follows an optimizer step, as in training
            self._ckpt.step()
            self._ckpt.save(blocking=True)

    def run(self) -> Sample:
        for path in self._ckpt.directory.glob("step_*/*.safetensors"):
            (drop_cache if self.cold else warm_cache)(path)
        start = time.perf_counter()
        self._ckpt.restore()
        return Sample(stall=time.perf_counter() - start)
