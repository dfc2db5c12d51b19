"""A data-parallel run that loses a rank, or a whole torchrun agent, at a chosen phase: the fault matrix
(tests/distributed/test_faults.py).

Runs under ``torchrun`` (DDP over gloo), or as one plain process (the uninterrupted run to compare
with). The job of ``elastic_train.py``: a ``ResumableLoader`` with
``--global-batch`` samples per optimizer step over the ranks, an MLP, AdamW and an LR schedule, so
that a job resumed on fewer ranks takes the same global batches. The policy checkpoints every
``--every`` steps, but is one the ranks vote on (so that the vote runs); ``--remote`` adds a shared
remote tier and each agent passes its own ``--ckpt-dir`` (its node-local directory).

``--wait-remote-before STEP``: each checkpoint before step STEP is in the remote tier before training
goes on (so that a node lost later leaves a checkpoint the survivors can read; the checkpoints from
STEP on are written in the background while training goes on).

``--faults PHASE:RANK:STEP:WHAT,...``: the faults, in order, each once (``--markers`` holds a file per
fault done, with the time of the kill and the pids killed). Rank RANK SIGKILLs itself (WHAT ``rank``)
or its torchrun agent, the agent's other workers and itself (WHAT ``agent``: a node lost), or
SIGSTOPs them all (WHAT ``freeze``: a node that vanished without closing its connections, as a
powered-off machine does; the harness kills them at the end) when, at or after optimizer step
STEP, it reaches PHASE:

* ``between``: after ``step()`` returned at step STEP (no checkpoint in flight: STEP is not a
  checkpoint's step and the one before it is durable);
* ``snapshot``: as the snapshot of a checkpoint begins (``Snapshotter.take``);
* ``gather``: as it sends its report in a commit's gather (the commit's second gather);
* ``broadcast``: as it waits for rank 0's verdict in a commit (the commit's second broadcast; RANK > 0);
* ``upload``: as it copies its data file to the remote tier;
* ``restore``: as it exchanges data in the restore (a message, or the replicated rows) — STEP is ignored;
* ``vote``: as its vote thread exchanges a vote on when to checkpoint;
* ``replica-send``: as its thread copying a memory snapshot of step STEP or later to another
  machine (``replicas=1``, :func:`inject_replicas`) has sent the header and the data, before the manifest;
* ``replica-keep``: as its thread keeping the copies another rank sends has received all of that
  copy's bytes, before it commits them.

The faults are injected by wrapping checkfreq's own functions from this script: the library has no test hooks.
Each rank appends one line per step to ``--step-log`` (``elastic_train.py``'s format) and prints
``life=L rank=R world=W restored step=S at=T`` after each restore; rank 0 writes the final state to ``--final``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
from noisy_points import NoisyPoints  # beside this script
from torch import nn
from worker_exit import exit_without_teardown  # beside this script

from checkfreq import Checkpointer
from checkfreq.data import ResumableLoader
from checkfreq.pipeline.capture.snapshot import Snapshotter
from checkfreq.pipeline.tiers.memory import replicas
from checkfreq.pipeline.tiers.remote import RemoteTier
from checkfreq.policies import DecisionContext, Policy
from checkfreq.ranks.agreement import VOTE_ACTIVITY
from checkfreq.ranks.collectives import GroupPeers
from checkfreq.storage.format import checkpoint_name
from checkfreq.storage.shm import MemoryRegion

STACKS_SIGNAL = signal.SIGUSR1
"""A worker prints every thread's stack to its output on this signal (tests/distributed/test_faults.py, a hang)."""
step_now = 0  # the optimizer step the training loop is at (read by the writer and vote threads)


class VotedEvery(Policy):
    """Every ``n`` steps, but a policy the ranks vote on (any policy but a step count is)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.interval = n  # what the vote reads: it then votes at every step

    def should_save(self, ctx: DecisionContext) -> bool:
        return ctx.step % self.n == 0


class Faults:
    """This rank's faults; :meth:`hit` kills when the next undone fault is this rank's at ``phase``."""

    def __init__(self, spec: str, markers: Path, rank: int) -> None:
        self.faults = [tuple(f.split(":")) for f in filter(None, spec.split(","))]
        self.markers, self.rank = markers, rank
        self.lock = threading.Lock()

    def next(self) -> tuple[int, tuple[str, ...]] | None:
        for number, fault in enumerate(self.faults):
            if not (self.markers / f"fault{number}").exists():
                return number, fault
        return None

    def hit(self, phase: str, step: int | None = None) -> None:
        with self.lock:
            due = self.next()
            if due is None:
                return
            number, (want, rank, at, what) = due
            if want != phase or int(rank) != self.rank or (step is not None and step < int(at)):
                return
            me = psutil.Process()
            doomed = [me] if what == "rank" else [me.parent(), *me.parent().children()]
            stop = signal.SIGSTOP if what == "freeze" else signal.SIGKILL
            record = {
                "time": time.time(),
                "phase": phase,
                "rank": self.rank,
                "what": what,
                "step": step,
                "pids": [p.pid for p in doomed],
                "ranks": [self.rank] if what == "rank" else sibling_ranks(),
            }
            temporary = self.markers / f"fault{number}.tmp"
            temporary.write_text(json.dumps(record))
            temporary.rename(self.markers / f"fault{number}")
            for process in doomed:  # the agent first: it must not restart anything
                if process.pid != me.pid:
                    process.send_signal(stop)
            os.kill(os.getpid(), stop)


def sibling_ranks() -> list[int]:
    """The global ranks of this worker's agent (its node)."""
    local, first = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["GROUP_RANK"])
    return list(range(first * local, (first + 1) * local))


def inject(faults: Faults) -> None:
    """Wrap checkfreq's functions so that each phase calls ``faults.hit`` (on whichever thread runs it)."""
    take, gather, broadcast, send, receive = (
        Snapshotter.take,
        GroupPeers.gather,
        GroupPeers.broadcast,
        GroupPeers.send,
        GroupPeers.receive,
    )
    rows, copy = GroupPeers.all_gather_rows, RemoteTier._copy
    rounds: dict[tuple[str, str], int] = {}

    def counted(peers: GroupPeers, kind: str) -> int:
        key = (kind, peers.activity)
        rounds[key] = rounds.get(key, 0) + 1
        return rounds[key]

    def commit_step(peers: GroupPeers) -> int | None:
        prefix = "the commit of step "
        return int(peers.activity[len(prefix) :]) if peers.activity.startswith(prefix) else None

    def take_hooked(self: Snapshotter, *args: Any, **kwargs: Any) -> Any:
        faults.hit("snapshot", step_now)
        return take(self, *args, **kwargs)

    def gather_hooked(self: GroupPeers, value: Any) -> Any:
        step = commit_step(self)
        if step is not None and counted(self, "gather") == 2:
            faults.hit("gather", step)
        return gather(self, value)

    def broadcast_hooked(self: GroupPeers, value: Any) -> Any:
        step = commit_step(self)
        if step is not None and counted(self, "broadcast") == 2:
            faults.hit("broadcast", step)
        return broadcast(self, value)

    def exchange(self: GroupPeers) -> None:
        if self.activity == "the restore":
            faults.hit("restore")
        elif self.activity == VOTE_ACTIVITY:
            faults.hit("vote", step_now)

    def send_hooked(self: GroupPeers, payload: torch.Tensor, to: int) -> None:
        exchange(self)
        send(self, payload, to)

    def receive_hooked(self: GroupPeers, size: int, sender: int) -> torch.Tensor:
        exchange(self)
        return receive(self, size, sender)

    def rows_hooked(self: GroupPeers, row: torch.Tensor) -> torch.Tensor:
        exchange(self)
        return rows(self, row)

    def copy_hooked(self: RemoteTier, path: Path, *args: Any) -> None:
        step = re.search(r"step_(\d+)", str(path))
        if step is not None and checkpoint_name(int(step[1])) in str(path):
            faults.hit("upload", int(step[1]))
        copy(self, path, *args)

    Snapshotter.take = take_hooked  # type: ignore[method-assign]
    GroupPeers.gather, GroupPeers.broadcast = gather_hooked, broadcast_hooked  # type: ignore[method-assign]
    GroupPeers.send, GroupPeers.receive = send_hooked, receive_hooked  # type: ignore[method-assign]
    GroupPeers.all_gather_rows = rows_hooked  # type: ignore[method-assign]
    RemoteTier._copy = copy_hooked  # type: ignore[method-assign]


def inject_replicas(faults: Faults) -> None:
    """Wrap what the replica threads call (``checkfreq.pipeline.tiers.memory.replicas``) so that a copy in flight
    calls ``faults.hit`` at the ``replica-send`` and ``replica-keep`` phases (scripts/fsdp_memory.py)."""
    real, commit = replicas.dist, MemoryRegion.commit
    copy = threading.local()  # the sender thread's copy in flight: its step, and its messages sent so far

    class Wire:
        """torch.distributed as the replica module sees it: the sender's messages counted."""

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def send(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            if threading.current_thread().name == "checkfreq-replica-send":
                if tensor.dtype == torch.int64 and tensor.numel() == replicas.CopyHeader.WIDTH:  # a copy begins
                    copy.step, copy.sent = replicas.CopyHeader.from_tensor(tensor).step, 0
                else:
                    copy.sent += 1
                    if copy.sent == 2:  # the data is out; the manifest would go next
                        faults.hit("replica-send", copy.step)
            real.send(tensor, *args, **kwargs)

    def commit_hooked(self: MemoryRegion, target: Any, step: int, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("expect") is not None and threading.current_thread().name.startswith("checkfreq-replica-keep"):
            faults.hit("replica-keep", step)
        return commit(self, target, step, *args, **kwargs)

    replicas.dist = Wire()  # type: ignore[assignment]
    MemoryRegion.commit = commit_hooked  # type: ignore[method-assign]


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--remote", default=None)
    parser.add_argument("--final", required=True)
    parser.add_argument("--step-log", required=True)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--failure-timeout", type=float, default=None)
    parser.add_argument("--faults", default="")
    parser.add_argument("--markers", required=True)
    parser.add_argument("--wait-remote-before", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    global step_now
    args = parse()
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # the harness asks a hung worker where it is
    torch.set_num_threads(1)
    loader = ResumableLoader(NoisyPoints(args.samples), shuffle=True, seed=5, global_batch_size=args.global_batch)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    faults = Faults(args.faults, Path(args.markers), rank)
    inject(faults)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 3))
    net = nn.parallel.DistributedDataParallel(model) if distributed else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
    options = {} if args.failure_timeout is None else {"failure_timeout": args.failure_timeout}
    ckpt = Checkpointer(
        args.ckpt_dir,
        policy=VotedEvery(args.every),
        keep=2,
        remote=args.remote,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
        **options,
    )
    step_now = ckpt.restore()
    print(
        f"life={life} rank={rank} world={world} restored step={step_now} at={time.time()!r}\n", end="", flush=True
    )  # one write, newline included: the ranks share the agent's stdout

    with open(args.step_log, "a") as log:
        for _ in range(loader.epoch, args.epochs):
            for x, y, index in loader:
                losses = nn.functional.cross_entropy(net(x), y, reduction="none")
                losses.mean().backward()  # DDP averages over the ranks: the global batch's mean
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                step_now += 1
                started = ckpt.step()
                if started and ckpt.global_step < args.wait_remote_before:
                    ckpt.wait(remote=True)  # collective: the checkpoints before the faults are in the remote tier
                step_loss = losses.detach().sum()
                if distributed:
                    dist.all_reduce(step_loss)
                fingerprint = sum(p.detach().double().sum() for p in model.parameters()).item()
                log.write(
                    f"{life} {ckpt.global_step} {rank} {world} 1 {step_loss.item() / args.global_batch!r} "
                    f"{fingerprint!r} "
                    f"{' '.join(map(str, index.tolist()))}\n"
                )
                log.flush()
                due = faults.next()
                if due is not None and due[1][0] == "between" and not started:
                    ckpt.wait()  # nothing in flight
                    faults.hit("between", ckpt.global_step)
    if rank == 0:
        torch.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
            args.final,
        )
    ckpt.close()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
