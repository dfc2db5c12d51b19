"""The job ``benchmarks/goodput.py`` runs under torchrun: DDP on gloo, trained until a deadline, saved
and restored as one of the variants the benchmark compares, each phase of each start marked.

Variants (``--mode``):

* ``checkfreq-memory``: ``Checkpointer(memory=1, replicas=1)``, default policy, ``restore()``;
* ``checkfreq-disk``: ``Checkpointer()``, default policy, disk only;
* ``torch-save``: rank 0 ``torch.save`` every ``--every`` steps (written aside, then renamed), loaded at start;
* ``dcp-async``: ``torch.distributed.checkpoint.async_save`` every ``--every`` steps, each into a
  directory of its own; at start the newest one whose ``.metadata`` exists is loaded (DCP's recipe);
* ``none``: no checkpoint (the fault-free reference).

Every rank appends JSON lines to ``<marks>/rank<R>.jsonl``: ``start`` (the interpreter began, before
its imports), ``imported``, ``group`` (the process group is up), ``model`` (built), ``setup`` (the
variant's checkpointer made), ``restored`` (with the step), ``failed`` (the error the rank left on),
and at the end ``end`` with the step and a digest of the model and optimizer state; rank 0 marks
each ``step`` too (with ``--digests``, the reference's, with the state's digest). The batches are a
function of the step alone, so a run that restores exactly ends where an uninterrupted one does,
bit for bit.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: what a restart pays for them is measured

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import xxhash  # noqa: E402

MODES = ("checkfreq-memory", "checkfreq-disk", "torch-save", "dcp-async", "none")


class Marks:
    """This rank's phase marks, one JSON line each, appended and flushed at once (a kill loses none)."""

    def __init__(self, directory: str, rank: int, life: int) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._fd = os.open(f"{directory}/rank{rank}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.rank, self.life = rank, life

    def __call__(self, phase: str, t: float | None = None, **fields: Any) -> None:
        line = {"t": time.time() if t is None else t, "phase": phase, "rank": self.rank, "life": self.life, **fields}
        os.write(self._fd, (json.dumps(line) + "\n").encode())


def build(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same model and optimizer on every rank and at every start."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 8),
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``: a function of both alone (any restart replays it)."""
    generator = torch.Generator().manual_seed(step * 4099 + rank)
    return torch.randn(32, 64, generator=generator), torch.randn(32, 8, generator=generator)


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """A digest of every parameter and optimizer tensor, in a fixed order."""
    hasher = xxhash.xxh3_64()
    for tensor in model.state_dict().values():
        hasher.update(tensor.detach().contiguous().numpy().tobytes())
    for state in optimizer.state_dict()["state"].values():
        for value in state.values():
            hasher.update(torch.as_tensor(value).contiguous().numpy().tobytes())
    return hasher.hexdigest()


class Saver:
    """The variant's saves and its restore at start."""

    def __init__(self, mode: str, directory: str, every: int, model: torch.nn.Module, optimizer: Any) -> None:
        self.mode, self.directory, self.every = mode, Path(directory), every
        self.model, self.optimizer = model, optimizer
        self.ckpt: Any = None
        self._pending: Any = None
        self._group = dist.new_group(backend="gloo") if mode == "dcp-async" else None
        """DCP's advice: async saves on a group of their own, not beside training's collectives."""
        if mode.startswith("checkfreq"):
            import checkfreq

            memory = {"memory": 1, "replicas": 1} if mode == "checkfreq-memory" else {}
            self.ckpt = checkfreq.Checkpointer(directory, model=model, optimizer=optimizer, **memory)

    def restore(self) -> int:
        if self.ckpt is not None:
            return int(self.ckpt.restore())
        if self.mode == "torch-save":
            path = self.directory / "latest.pt"
            if not path.exists():
                return 0
            saved = torch.load(path, weights_only=True)
            self.model.load_state_dict(saved["model"])
            self.optimizer.load_state_dict(saved["optimizer"])
            return int(saved["step"])
        if self.mode == "dcp-async":
            return self._dcp_load()
        return 0

    def _dcp_load(self) -> int:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        done = sorted(int(p.parent.name.split("_")[1]) for p in self.directory.glob("step_*/.metadata"))
        if not done:
            return 0
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(self.directory / f"step_{done[-1]}"))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        return done[-1]

    def stepped(self, step: int) -> None:
        if self.ckpt is not None:
            self.ckpt.step()
        elif self.mode == "torch-save" and step % self.every == 0 and dist.get_rank() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": step}
            torch.save(state, self.directory / "latest.pt.tmp")
            os.replace(self.directory / "latest.pt.tmp", self.directory / "latest.pt")
        elif self.mode == "dcp-async" and step % self.every == 0:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            if self._pending is not None:
                self._pending.result()
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            state = {"model": model_state, "optimizer": optim_state}
            checkpoint_id = str(self.directory / f"step_{step}")
            self._pending = dcp.async_save(state, checkpoint_id=checkpoint_id, process_group=self._group)

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
        elif self._pending is not None:
            self._pending.result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--dir", required=True, help="the checkpoint directory")
    parser.add_argument("--marks", required=True, help="the marks' directory")
    parser.add_argument("--deadline", type=float, required=True, help="the wall time (Unix) training stops at")
    parser.add_argument("--every", type=int, default=500, help="torch-save and dcp-async: steps between saves")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--digests", action="store_true", help="rank 0 marks the state's digest at every step")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    mark = Marks(args.marks, rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    mark("start", t=STARTED)
    mark("imported")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mark("group")
    model, optimizer = build(args.width)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    mark("model")
    saver = Saver(args.mode, args.dir, args.every, model, optimizer)
    mark("setup")
    try:
        step = saver.restore()
        mark("restored", step=step)
        stop = torch.zeros(1)
        while True:
            stop[0] = float(time.time() >= args.deadline)
            dist.broadcast(stop, 0)  # rank 0's clock decides: every rank stops at the same step
            if stop[0]:
                break
            inputs, targets = batch(step, rank)
            loss = torch.nn.functional.mse_loss(ddp(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            saver.stepped(step)
            if rank == 0:
                mark("step", step=step, **({"digest": digest(model, optimizer)} if args.digests else {}))
        saver.close()
    except BaseException as e:
        mark("failed", error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise
    mark("end", step=step, digest=digest(model, optimizer))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
