"""Peak extra resident memory of checkfreq, measured in a fresh process.

Linux keeps the process's peak RSS (``VmHWM``) and lets a process reset it by writing ``5`` to
``/proc/self/clear_refs``. The state is built first; the peak is then reset, checkpoints are
taken (and one restore), and the peak minus the resident size before is what checkfreq added.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import checkfreq as cf
from benchmarks.states import build_state

NEVER = cf.Every(n=10**12)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> int:
    """Reset the peak RSS; return the current RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def _peak() -> int:
    return _status_kib("VmHWM") * 1024


def bench_memory(megabytes: float, checkpoints: int = 3) -> dict[str, float]:
    """Peak extra RSS (bytes) of ``checkpoints`` saves, then of one restore, over the state's own memory."""
    state = build_state(megabytes)
    with tempfile.TemporaryDirectory(prefix="cf-mem-") as tmp:
        before = _reset_peak()
        with cf.Checkpointer(Path(tmp), model=state.model, optimizer=state.optimizer, policy=NEVER, keep=1) as ckpt:
            for _ in range(checkpoints):
                # no gradients: changes nothing; step() follows an optimizer step, as in training
                state.optimizer.step()
                ckpt.step()
                ckpt.save()
                state.optimizer.step()  # the fence
                ckpt.wait()
            save_peak = _peak() - before
            before_restore = _reset_peak()
            ckpt.restore()
            restore_peak = _peak() - before_restore
    return {"nbytes": state.nbytes, "save_peak_extra": save_peak, "restore_peak_extra": restore_peak}
