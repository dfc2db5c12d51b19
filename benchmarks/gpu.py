"""checkfreq on a GPU as users train: a 1B-parameter GPT, each checkpointing mode for some steps, one process.

    python -m benchmarks.gpu                      # the 1.04B model (d=2048, 18 layers, vocab 32k), on CUDA
    python -m benchmarks.gpu --optimizer adamw    # the same with non-fused AdamW (what most users run)
    python -m benchmarks.gpu --size small         # 4 layers (~4 GB of state): for the disk-bound modes
    python -m benchmarks.gpu --tiny --device cpu  # the same modes on a toy model, in seconds (CI)
    python -m benchmarks.gpu --json out.json      # also the raw figures

The model: a pre-LayerNorm GPT with causal self-attention, trained with bf16 autocast and fp32
AdamW (fused by default; ``--optimizer adamw``: torch's default implementation, whose ``step``
counters are CPU tensors) on batches of 16×1024 random tokens (12.47 GB of checkpointed state: fp32
parameters and two Adam moments). Modes, each on the same model, in this order, after ``--warmup`` steps:

* ``none``: no checkpointing (the baseline every mode is relative to);
* ``default``: ``Checkpointer(dir, model=, optimizer=)`` (``policy="auto"``);
* ``memory=1``: a memory-tier snapshot every step (default policy for disk);
* ``memory=True``: the memory tier's adaptive cadence;
* ``memory=2+gpu_staging``: a memory snapshot every 2 steps through the GPU staging buffer;
* ``policy=10``: durable every 10 steps, waiting for the previous persist if it is still running;
* ``DCP async_save/10``: ``torch.distributed.checkpoint.async_save`` every 10 steps, a fresh
  ``DefaultStager`` per save (torch 2.11 fails when one is reused); a failure is reported as
  ``failed``, never ends the run.

Each mode reports its mean step relative to ``none``, the snapshot, fence, GPU-wait, busy-wait
and persist times from its events, and (memory tiers) how long ``restore()`` took from memory and
from disk. A step is timed on the training stream (CUDA events around it), never with
``torch.cuda.synchronize()``, which would also wait for the side stream's copy to the host that
runs while the next steps compute; beside it, the stall checkfreq's own events saw per step (its
snapshot stalls, fence waits, busy waits and GPU-timed waits), so that the two can be compared.
The physical limits are measured in the same run (``--no-limits`` skips them): pinned and pageable
device-to-host copies, a ``/dev/shm`` mapping registered with ``cudaHostRegister``,
device-to-device, disk write.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import checkfreq as cf
from benchmarks.limits import write_fsync
from checkfreq.run.events import read_events
from checkfreq.storage.host_pinning import host_registry


@dataclass(frozen=True)
class Size:
    """The model and batch of one configuration."""

    d: int
    layers: int
    heads: int
    vocab: int
    batch: int
    seq: int


FULL = Size(d=2048, layers=18, heads=16, vocab=32000, batch=16, seq=1024)
SMALL = Size(d=2048, layers=4, heads=16, vocab=32000, batch=16, seq=1024)
TINY = Size(d=64, layers=2, heads=4, vocab=256, batch=2, seq=32)
SIZES = {"full": FULL, "small": SMALL, "tiny": TINY}


class Block(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.heads = size.heads
        self.ln1, self.ln2 = nn.LayerNorm(size.d), nn.LayerNorm(size.d)
        self.qkv, self.proj = nn.Linear(size.d, 3 * size.d), nn.Linear(size.d, size.d)
        self.up, self.down = nn.Linear(size.d, 4 * size.d), nn.Linear(4 * size.d, size.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(attn)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(size.vocab, size.d), nn.Embedding(size.seq, size.d)
        self.blocks = nn.ModuleList(Block(size) for _ in range(size.layers))
        self.ln, self.head = nn.LayerNorm(size.d), nn.Linear(size.d, size.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Trainer:
    """The model, its optimizer and one training step (bf16 autocast on CUDA)."""

    def __init__(self, size: Size, device: torch.device, optimizer: str = "fused") -> None:
        torch.manual_seed(0)
        self.size, self.device = size, device
        self.model = GPT(size).to(device)
        fused = device.type == "cuda" and optimizer == "fused"  # else torch's default: step counters on the CPU
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=fused)
        self.tokens = torch.randint(0, size.vocab, (size.batch, size.seq + 1), device=device)

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def step(self) -> float:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = self.model(self.tokens[:, :-1])
            loss = F.cross_entropy(logits.float().view(-1, self.size.vocab), self.tokens[:, 1:].reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return loss.item()  # syncs with the GPU, as a logging loop does: the step's wall time is its GPU time

    def state_bytes(self) -> int:
        tensors = [*self.model.state_dict().values()]
        tensors += [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------------- modes

Hooks = tuple[Callable[[], None], Callable[[], None]]
"""(after each step, at the end of the mode) of a checkpointing mode."""


def checkfreq_mode(**options: Any) -> Callable[[Trainer, Path], tuple[Hooks, cf.Checkpointer]]:
    def start(trainer: Trainer, directory: Path) -> tuple[Hooks, cf.Checkpointer]:
        ckpt = cf.Checkpointer(directory, model=trainer.model, optimizer=trainer.optimizer, keep=1, **options)
        return (lambda: ckpt.step(), ckpt.wait), ckpt

    return start


class DcpEvery:
    """``dcp.async_save`` every ``n`` steps with a fresh stager per save; the previous save must be
    durable before the next starts (as DCP's docs ask). Failures are recorded, never raised."""

    def __init__(self, trainer: Trainer, directory: Path, n: int) -> None:
        self.trainer, self.directory, self.n = trainer, directory, n
        self.steps = 0
        self.stalls: list[float] = []
        """Seconds each ``async_save`` call took (the previous save's wait included)."""
        self.waits: list[float] = []
        """Seconds each save waited for the previous one to be durable."""
        self.failed: str | None = None
        self._pending: Any = None
        self._stager: Any = None
        self._path: Path | None = None

    def after_step(self) -> None:
        self.steps += 1
        if self.failed is not None or self.steps % self.n:
            return
        try:
            self._save()
        except Exception as e:  # the peer's failure is a result, not the end of the run
            self.failed = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            traceback.print_exc()

    def _save(self) -> None:
        import torch.distributed.checkpoint as dcp

        from benchmarks.baselines import dcp_stager

        start = time.perf_counter()
        self._finish()
        self.waits.append(time.perf_counter() - start)
        state = {"model": self.trainer.model.state_dict(), "optimizer": self.trainer.optimizer.state_dict()}
        self._stager = dcp_stager(self.trainer.device.type == "cuda", async_staging=False)
        self._path = self.directory / f"step_{self.steps}"
        self._pending = dcp.async_save(
            state, storage_writer=dcp.FileSystemWriter(self._path), async_stager=self._stager, no_dist=True
        )
        self.stalls.append(time.perf_counter() - start)

    def _finish(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            getattr(pending, "upload_completion", pending).result()
            self._stager.close()
            for old in self.directory.glob("step_*"):  # keep=1, as the checkfreq modes
                if old != self._path:
                    shutil.rmtree(old, ignore_errors=True)

    def end(self) -> None:
        try:
            self._finish()
        except Exception as e:
            self.failed = self.failed or f"{type(e).__name__}: {e}".splitlines()[0][:200]


MODES: dict[str, dict[str, Any]] = {  # the acceptance rows first: a run cut short keeps them
    "none": {},
    "memory=1": {"memory": 1},
    "memory=True": {"memory": True},
    "default": {},
    "memory=2+gpu_staging": {"memory": 2, "gpu_staging": True},
    "policy=10": {"policy": 10},
    "DCP async_save/10": {},
}


def run_mode(name: str, trainer: Trainer, workdir: Path, steps: int, warmup: int) -> dict[str, Any]:
    """Train ``warmup + steps`` steps under mode ``name``; its step times and figures."""
    directory = workdir / name.replace(" ", "").replace("=", "-").replace(",", "_").replace("/", "-")
    directory.mkdir(parents=True)
    ckpt: cf.Checkpointer | None = None
    dcp_mode: DcpEvery | None = None
    after: Callable[[], None] = lambda: None  # noqa: E731
    end: Callable[[], None] = lambda: None  # noqa: E731
    if name == "DCP async_save/10":
        dcp_mode = DcpEvery(trainer, directory, 10)
        after, end = dcp_mode.after_step, dcp_mode.end
    elif name != "none":
        (after, end), ckpt = checkfreq_mode(**MODES[name])(trainer, directory)
    times = StepTimes(trainer.device)
    for i in range(warmup + steps):
        times.begin()
        trainer.step()  # its loss.item() waits for the training stream only
        after()
        times.end(timed=i >= warmup)
    start = time.perf_counter()
    end()
    result: dict[str, Any] = {
        "step_s": times.seconds(),
        "end_s": time.perf_counter() - start,
        "steps_total": warmup + steps,
    }
    if dcp_mode is not None:
        result.update(stall_s=dcp_mode.stalls, wait_previous_s=dcp_mode.waits, failed=dcp_mode.failed)
    if ckpt is not None:
        tier_off = bool(MODES[name].get("memory")) and not any(e["event"] == "memory" for e in read_events(directory))
        if tier_off:  # a memory mode must never be timed as disk-only checkpointing under its name
            result["failed"] = (
                "the memory tier took no snapshot: it turned itself off (/dev/shm too small? see the log)"
            )
        elif name.startswith("memory"):  # from disk too once: reading 12.5 GB from disk takes seconds
            result["restore"] = restores(ckpt, directory, disk=name == "memory=1")
        ckpt.close()
        result["events"] = summarise(read_events(directory))
    shutil.rmtree(directory, ignore_errors=True)
    return result


class StepTimes:
    """Each step's time on the training stream: CUDA events recorded on it before and after the step
    (read once the mode is over), or the CPU's clock without CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[Any, Any]] = []
        self._cpu: list[float] = []
        self._start: Any = None

    def begin(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def end(self, timed: bool) -> None:
        if self.cuda:
            stop = torch.cuda.Event(enable_timing=True)
            stop.record()
            if timed:
                self._marks.append((self._start, stop))
        elif timed:
            self._cpu.append(time.perf_counter() - self._start)

    def seconds(self) -> list[float]:
        if not self.cuda:
            return self._cpu
        self._marks[-1][1].synchronize()
        return [start.elapsed_time(stop) / 1000.0 for start, stop in self._marks]


def restores(ckpt: cf.Checkpointer, directory: Path, disk: bool) -> dict[str, float]:
    """Seconds of ``restore()`` (its ``restore_s``) from the newest state (the memory tier's), then (with
    ``disk``) from the newest checkpoint on disk if there is one: ``{"<tier>_s": seconds}``."""
    ckpt.wait()
    out: dict[str, float] = {}

    def restore(step: int | None = None) -> None:
        ckpt.restore(step)
        event = [e for e in read_events(directory) if e["event"] == "restore"][-1]
        out[f"{'disk' if event['tier'] == 'local' else event['tier']}_s"] = event["restore_s"]

    restore()
    on_disk = sorted(int(p.name[5:]) for p in ckpt.directory.glob("step_*") if p.name[5:].isdigit())
    if disk and on_disk:
        restore(on_disk[-1])
    return out


def summarise(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts and mean seconds of the events that say what checkpointing cost."""

    def mean(kind: str, key: str, **match: Any) -> dict[str, float]:
        values = [
            e[key]
            for e in events
            if e["event"] == kind and all(e.get(k) == v for k, v in match.items()) and e.get(key) is not None
        ]
        return {
            "n": len(values),
            "mean": statistics.fmean(values) if values else math.nan,
            "max": max(values, default=math.nan),
        }

    return {
        "snapshots": {kind: sum(e["event"] == kind for e in events) for kind in ("snapshot", "memory")},
        "snapshot stall_s": mean("snapshot", "stall_s"),
        "fence wait_s": mean("fence", "wait_s"),
        "memory stall_s": mean("memory", "stall_s"),
        "gpu_wait s": mean("gpu_wait", "wait_s"),
        "busy wait_s": mean("busy", "wait_s"),
        "persist_s": mean("commit", "persist_s"),
        "bandwidth GB/s": mean("commit", "bandwidth_gbps"),
        "restore_s": mean("restore", "restore_s"),
        "stall total_s": sum(e.get(key) or 0.0 for e in events for kind, key in STALLS if e["event"] == kind),
    }


STALLS = (("snapshot", "stall_s"), ("memory", "stall_s"), ("fence", "wait_s"), ("gpu_wait", "wait_s"))
"""The events whose seconds are a stall of training, as checkfreq measured it (a busy wait is part of its
snapshot's stall already)."""


def events_stall_per_step(mode: dict[str, Any]) -> float | None:
    """The stall checkfreq's events saw, per step of the mode (warm-up steps included: they are in the events)."""
    ev = mode.get("events")
    return None if ev is None else ev["stall total_s"] / mode["steps_total"]


# ---------------------------------------------------------------------- limits

LIMIT_BYTES = 4 << 30
"""The limits copy the state's size, or this much if the state is larger (a few seconds)."""


def limits(n: int, device: torch.device, workdir: Path) -> dict[str, float]:
    """Bandwidths (GB/s) of the copies a snapshot makes, each on ``n`` bytes."""
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    out: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], None]) -> None:
        fn()  # warm
        sync()
        start = time.perf_counter()
        fn()
        sync()
        out[name] = n / (time.perf_counter() - start) / 1e9

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
    pageable = torch.empty(n, dtype=torch.uint8)
    timed("D2H pinned copy_ GB/s", lambda: pinned.copy_(src, non_blocking=True))
    timed("D2H pageable copy_ GB/s", lambda: pageable.copy_(src))
    timed("H2D pinned copy_ GB/s", lambda: src.copy_(pinned, non_blocking=True))
    copy = torch.empty_like(src)
    timed("D2D copy_ GB/s", lambda: copy.copy_(src))
    copy = None  # give the device memory back
    shm_limits(n, src, timed, cuda=device.type == "cuda")
    path = workdir / "limit.bin"
    timed_once = time.perf_counter()
    write_fsync(path, memoryview(pinned.numpy()))
    out["disk write+fsync GB/s"] = n / (time.perf_counter() - timed_once) / 1e9
    path.unlink()
    return out


def shm_limits(n: int, src: torch.Tensor, timed: Callable[[str, Callable[[], None]], None], *, cuda: bool) -> None:
    """Device-to-host copies into an ``n``-byte /dev/shm mapping, plain and registered; skipped (and
    said so) when /dev/shm has less than twice that free, so that the memory tier still has room."""
    shm = Path(os.environ.get("CHECKFREQ_SHM_DIR") or "/dev/shm") / f"checkfreq-bench-{os.getpid()}"
    stats = os.statvfs(shm.parent)
    if stats.f_bavail * stats.f_frsize < 2 * n:
        print(
            f"skipping the /dev/shm limits: {stats.f_bavail * stats.f_frsize / 1e9:.1f} GB free there, "
            f"{2 * n / 1e9:.1f} GB wanted",
            flush=True,
        )
        return
    try:
        with open(shm, "w+b") as f:
            f.truncate(n)
            mapping = mmap.mmap(f.fileno(), n)
        shared = torch.frombuffer(mapping, dtype=torch.uint8)
        timed("D2H into /dev/shm mapping GB/s", lambda: shared.copy_(src, non_blocking=True))
        registry = host_registry()
        if cuda and registry.register(shared.data_ptr(), n):
            timed("D2H into registered /dev/shm GB/s", lambda: shared.copy_(src, non_blocking=True))
            registry.unregister(shared.data_ptr())
        shared = None  # the mapping cannot close while a tensor uses it
        mapping.close()
    finally:
        shm.unlink(missing_ok=True)


def tier_copy(trainer: Trainer, workdir: Path) -> dict[str, float]:
    """The memory tier's copy of the whole state, GB/s: a snapshot into a slot (the side stream's
    copies) until it is committed (the checksum of a large state is sealed afterwards, not counted).
    The third snapshot is timed: the first two create the region and register both slots, and each
    is sealed before the next starts, so that neither a registration nor a checksum overlaps the
    timed copy. Uses the tier directly, so no persist at close writes 12 GB to disk for nothing."""
    from checkfreq.pipeline.capture.snapshot import Snapshotter, layout_of
    from checkfreq.pipeline.tiers.memory.tier import MemoryTier
    from checkfreq.pipeline.tiers.roles import SnapshotRequest
    from checkfreq.policies.memory_cadence import MemoryCadence
    from checkfreq.storage.shm_paths import shm_directory

    tensors = {f"model/{k}": v for k, v in trainer.model.state_dict().items()}
    for i, state in trainer.optimizer.state.items():
        tensors.update({f"opt/{id(i)}/{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)})
    (workdir / "tier-copy").mkdir()
    tier = MemoryTier(workdir / "tier-copy", MemoryCadence(every=1), data_file="data.safetensors")
    snapshotter, seconds = Snapshotter(gpu_staging=False), []
    cuda = trainer.device.type == "cuda"
    try:
        for step in range(3):
            tier.wait_sealed()
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            layout = layout_of(tensors)
            target = tier.target(SnapshotRequest(layout, {}, step, None, {}, 0.0, device_copies=cuda, sharded=False))
            if target is None:  # the tier turned itself off (it warned why): a result, not the end of the run
                return {"skipped": f"no room in {shm_directory()} for two slots of {layout.nbytes / 1e9:.2f} GB"}
            tier.commit(target, snapshotter.take(tensors, set(tensors), layout=layout, buffer=target.buffer))
            seconds.append(time.perf_counter() - start)
    finally:
        tier.close(remove=True)
    return {"memory tier copy GB/s": layout.nbytes / seconds[-1] / 1e9, "memory tier first snapshot s": seconds[0]}


# ---------------------------------------------------------------------- report


def report(doc: dict[str, Any]) -> str:
    """The modes as a Markdown table (step times relative to ``none``), then the limits."""
    none = statistics.fmean(doc["modes"]["none"]["step_s"])
    lines = [
        f"{doc['device']}, {doc['parameters'] / 1e6:.1f}M parameters, {doc['state_bytes'] / 1e9:.2f} GB of state, "
        f"{doc['optimizer']} AdamW, {doc['steps']} steps a mode after {doc['warmup']} warm-up steps; a step is "
        "timed on the training stream",
        "",
        "| mode | mean step | vs none | snapshots (checkpoints, memory) | stall the events saw per step | "
        "snapshot stall | fence wait | GPU wait | busy wait | persist | restore from memory | restore from disk |",
        "|" + " --- |" * 12,
    ]
    for name, mode in doc["modes"].items():
        if "error" in mode:
            lines.append(f"| {name} | failed: {mode['error']} |" + " |" * 10)
            continue
        step = statistics.fmean(mode["step_s"])
        ev = mode.get("events", {})
        cells = [
            _ms(ev, "snapshot stall_s") if "memory" not in name else _ms(ev, "memory stall_s"),
            _ms(ev, "fence wait_s"),
            _ms(ev, "gpu_wait s"),
            _ms(ev, "busy wait_s"),
            _s(ev, "persist_s"),
        ]
        if name.startswith("DCP"):
            cells = [
                f"{statistics.fmean(mode['stall_s']) * 1e3:.0f} ms" if mode["stall_s"] else "–",
                "–",
                "–",
                f"{statistics.fmean(mode['wait_previous_s']):.2f} s" if mode["wait_previous_s"] else "–",
                "–",
            ]
        restore = mode.get("restore", {})
        cells += [_sec(restore.get("memory_s")), _sec(restore.get("disk_s"))]
        ratio = "failed: " + mode["failed"] if mode.get("failed") else f"{step / none:.3f}×"
        seen = events_stall_per_step(mode)
        cells.insert(0, "–" if seen is None else f"{seen * 1e3:.1f} ms")
        taken = ev.get("snapshots")
        cells.insert(0, "–" if taken is None else f"{taken['snapshot']}, {taken['memory']}")
        lines.append(f"| {name} | {step * 1e3:.0f} ms | {ratio} | " + " | ".join(cells) + " |")
    if "limits" not in doc:
        return "\n".join(lines)
    lines += ["", f"| limit ({doc['limit_bytes'] / 1e9:.2f} GB copied) | GB/s |", "| --- | --- |"]
    lines += [f"| {k[:-5]} | {v:.2f} |" for k, v in doc["limits"].items()]
    if "memory tier copy GB/s" not in doc["tier"]:
        return "\n".join([*lines, "", f"memory tier copy of the whole state: {doc['tier']}"])
    tier, pinned = doc["tier"]["memory tier copy GB/s"], doc["limits"]["D2H pinned copy_ GB/s"]
    lines += [
        "",
        f"memory tier copy of the whole state: {tier:.2f} GB/s, {tier / pinned:.2f}× the pinned "
        f"device→host copy (target ≥ 0.8); its first snapshot (region created and pinned): "
        f"{doc['tier']['memory tier first snapshot s']:.2f} s",
    ]
    return "\n".join(lines)


def _ms(ev: dict[str, Any], key: str) -> str:
    m = ev.get(key, {})
    return "–" if not m.get("n") else f"{m['mean'] * 1e3:.1f} ms (n={m['n']}, max {m['max'] * 1e3:.0f})"


def _s(ev: dict[str, Any], key: str) -> str:
    m = ev.get(key, {})
    return "–" if not m.get("n") else f"{m['mean']:.2f} s (n={m['n']})"


def _sec(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f} s"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a toy model (seconds, for CI and a CPU): --size tiny")
    p.add_argument("--size", choices=list(SIZES), default="full", help="full: 1.04B parameters; small: 4 layers")
    p.add_argument(
        "--optimizer",
        choices=["fused", "adamw"],
        default="fused",
        help="fused AdamW, or torch's default AdamW (its step counters are CPU tensors)",
    )
    p.add_argument("--no-limits", action="store_true", help="skip the hardware limits and the tier copy")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=40, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per mode, before the timed ones")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes (default: all)")
    p.add_argument("--dir", type=Path, help="where checkpoints go (default: a temporary directory)")
    p.add_argument("--json", type=Path, help="also write the raw figures here")
    args = p.parse_args(argv)
    modes = ["none", *(m for m in args.modes.split(",") if m != "none")]  # every mode is relative to none
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")
    device = torch.device(args.device)
    trainer = Trainer(TINY if args.tiny else SIZES[args.size], device, args.optimizer)
    for _ in range(3):
        trainer.step()  # compile kernels, allocate the optimizer state
    with tempfile.TemporaryDirectory(prefix="cf-gpu-", dir=args.dir) as tmp:
        workdir = Path(tmp)
        doc: dict[str, Any] = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            "torch": torch.__version__,
            "parameters": trainer.parameters,
            "state_bytes": trainer.state_bytes(),
            "steps": args.steps,
            "warmup": args.warmup,
            "modes": {},
            "optimizer": "fused" if args.optimizer == "fused" and device.type == "cuda" else "non-fused",
        }
        if not args.no_limits:
            doc["limit_bytes"] = min(doc["state_bytes"], LIMIT_BYTES)
            doc["limits"] = limits(doc["limit_bytes"], device, workdir)
            try:
                doc["tier"] = tier_copy(trainer, workdir)
            except Exception as e:  # the modes are measured either way
                traceback.print_exc()
                doc["tier"] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:200]}
        for name in modes:
            try:
                doc["modes"][name] = run_mode(name, trainer, workdir, args.steps, args.warmup)
            except Exception as e:  # one mode's failure is a result: the others still run
                traceback.print_exc()
                doc["modes"][name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:200]}
            mode = doc["modes"][name]
            if "step_s" in mode:
                seen = events_stall_per_step(mode)
                print(
                    f"{name}: mean step on the training stream {statistics.fmean(mode['step_s']) * 1e3:.1f} ms; "
                    f"stall the events saw per step "
                    f"{'–' if seen is None else f'{seen * 1e3:.1f} ms'}",
                    flush=True,
                )
            if args.json is not None:  # after every mode: a run cut short keeps what it measured
                args.json.write_text(json.dumps(doc, indent=1, default=str))
    text = report(doc)
    print(text, flush=True)
    return doc


if __name__ == "__main__":
    main()
