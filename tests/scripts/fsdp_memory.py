"""An FSDP2 (or DDP) training run (CPU, gloo) with the memory tier, for tests/distributed/test_memory_group.py
and tests/distributed/test_memory_replicas.py.

``fully_shard`` on each layer and on the model (uneven shards: 33 rows over the ranks), AdamW, a
shuffled ``ResumableLoader`` with a fixed global batch. Restores from ``--ckpt-dir`` if it can, trains
to the end and every rank writes its local shards of the model and optimizer state (and its
values) to ``<final>.rank<r>.pt``.

* ``--ddp``: the model wrapped in ``DistributedDataParallel`` instead of sharded (every rank holds it whole).
* ``--samples N``, ``--global-batch B``: the data set's size and the global batch (64 and 16).
* ``--memory N``: a memory snapshot every N steps; ``--every K``: a persist every K steps.
* ``--die LIFE:RANK:STEP``: in incarnation LIFE, rank RANK waits for what is in flight, then
  SIGKILLs itself after optimizer step STEP (torchrun then restarts every rank).
* ``--replicas 1``, ``--remote PATH``: copies of each memory snapshot on the next node, a remote tier;
  ``--failure-timeout S``: the Checkpointer's.
* ``--kill-node STEP``: once (``--kill-marker`` is left behind: a replacement node's workers start
  at incarnation 0 again), after step STEP, every rank waits for what is in flight (the remote
  tier's copy and the replicas included); then every rank of the last node (the last ``--lost-nodes``
  nodes) SIGKILLs itself, each node's last one its torchrun agent first: the node is gone.
* ``--ballast-mb M``: each rank also keeps M MiB of a tensor of its own (one value of it changes at each
  step), so that a memory snapshot's copy to another node takes longer than a step: copies lag.
* ``--lose-node-now STEP``: as ``--kill-node``, but nothing in flight is waited for: the last node goes at
  once after step STEP, with copies of its snapshots in flight.
* ``--flip-copy``: with ``--kill-node``, once every rank waited, rank 0 changes one byte of the
  newest copy it keeps of the first lost rank's snapshots (a copy damaged in memory) before the node goes.
* ``--faults`` and ``--markers``: the fault matrix's faults (``fault_train.py``; here the phases
  ``replica-send`` and ``replica-keep``); then each restore prints ``... restored step=S at=T``, after
  a line for each memory copy this machine keeps (``keeps copy of rank R step=S valid=V``), and the
  checkpoints before ``--wait-remote-before`` are in the remote tier before training goes on.
* ``--step-log PATH``: each rank appends ``life step rank world loss`` after each step, the loss being
  the global batch's (averaged over the ranks); rank 0 writes every parameter, gathered, to
  ``<final>.full.pt`` at the end.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from fault_train import STACKS_SIGNAL, Faults, inject_replicas  # beside this script
from noisy_points import NoisyPoints  # beside this script
from torch import nn
from torch.distributed.fsdp import fully_shard
from worker_exit import exit_without_teardown  # beside this script

from checkfreq import Checkpointer
from checkfreq.data import ResumableLoader
from checkfreq.storage.shm import MemoryRegion
from checkfreq.storage.shm_paths import device_and_inode, replica_path
from checkfreq.tools.catalog import memory_snapshots


def local(value: Any) -> Any:
    """``value`` with every DTensor replaced by a copy of its local shard."""
    if isinstance(value, dict):
        return {k: local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [local(v) for v in value]
    return value.to_local().clone() if hasattr(value, "to_local") else value


def flip(directory: str, sender: int) -> None:
    """Change one byte of the data of the newest copy of rank ``sender``'s snapshots kept on this machine."""
    region = MemoryRegion(replica_path(directory, sender), device_and_inode(directory), tidy=False)
    info = region.snapshots()[0]
    data, _ = region.slot_bytes(info)
    data[data.numel() // 2] ^= 1
    region.release(remove=False)
    print(f"flipped a byte of the copy of rank {sender}'s snapshot {info.step}", flush=True)


def read_losses(log: Path) -> dict[int, float]:
    """The ``--step-log``: step → the global batch's loss (rank 0's line; a step run again after a
    restart replaces the earlier one)."""
    losses = {}
    for line in log.read_text().splitlines():
        _, step, rank, _, loss = line.split()
        if rank == "0":
            losses[int(step)] = float(loss)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--final", required=True)
    parser.add_argument("--memory", type=int, default=0)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--die", default="")
    parser.add_argument("--replicas", type=int, default=0)
    parser.add_argument("--remote", default=None)
    parser.add_argument("--kill-node", type=int, default=None)
    parser.add_argument("--step-log", default=None)
    parser.add_argument("--kill-marker", default=None)
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--lost-nodes", type=int, default=1)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--flip-copy", action="store_true")
    parser.add_argument("--ballast-mb", type=int, default=0)
    parser.add_argument("--lose-node-now", type=int, default=None)
    parser.add_argument("--faults", default="")
    parser.add_argument("--markers", default=None)
    parser.add_argument("--wait-remote-before", type=int, default=0)
    parser.add_argument("--failure-timeout", type=float, default=30.0)
    args = parser.parse_args()
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # the harness asks a hung worker where it is
    torch.set_num_threads(1)
    loader = ResumableLoader(NoisyPoints(args.samples), global_batch_size=args.global_batch, shuffle=True, seed=5)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.markers:
        inject_replicas(Faults(args.faults, Path(args.markers), rank))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 33), nn.ReLU(), nn.Linear(33, 16), nn.ReLU(), nn.Linear(16, 3))
    net: nn.Module = model
    if args.ddp:
        net = nn.parallel.DistributedDataParallel(model)
    else:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ckpt = Checkpointer(
        args.ckpt_dir,
        policy=args.every,
        keep=2,
        memory=args.memory or False,
        replicas=args.replicas,
        remote=args.remote,
        failure_timeout=args.failure_timeout,
        model=model,
        optimizer=optimizer,
        loader=loader,
    )
    ckpt["seen"] = torch.zeros(())
    if args.ballast_mb:
        ckpt["ballast"] = torch.full((args.ballast_mb << 18,), float(rank))
    if args.markers:  # what this machine keeps of other machines' snapshots, before the restore takes any
        for held in memory_snapshots(args.ckpt_dir):
            if held.name.startswith("memory copy of rank "):
                print(
                    f"life={life} rank={rank} keeps copy of rank {held.name.split()[4]} step={held.step} "
                    f"valid={held.valid}",
                    flush=True,
                )
    step = ckpt.restore()
    lost_before = args.kill_marker is not None and os.path.exists(args.kill_marker)
    at = f" at={time.time()!r}" if args.markers else ""
    print(
        f"life={life} rank={rank} world={world} restored step={step}{at}\n", end="", flush=True
    )  # one write, newline included: the ranks share the agent's stdout
    for _ in range(loader.epoch, args.epochs):
        for x, y, _ in loader:
            loss = nn.functional.cross_entropy(net(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ckpt["seen"] += len(y)
            if args.ballast_mb:
                ckpt["ballast"][ckpt.global_step % 1024] += 1.0
            if ckpt.step() and ckpt.global_step < args.wait_remote_before:
                ckpt.wait(remote=True)  # collective: the checkpoints before the faults are in the remote tier
            if args.step_log:
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                with open(args.step_log, "a") as log:
                    log.write(f"{life} {ckpt.global_step} {rank} {world} {mean.item() / world!r}\n")
            if args.die == f"{life}:{rank}:{ckpt.global_step}":
                ckpt.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            if args.lose_node_now == ckpt.global_step and not lost_before:
                if rank >= world - per_node:  # the last node's ranks, at once
                    open(args.kill_marker, "a").close()
                    if rank % per_node == per_node - 1:
                        os.kill(os.getppid(), signal.SIGKILL)
                    os.kill(os.getpid(), signal.SIGKILL)
            if args.kill_node == ckpt.global_step and not os.path.exists(args.kill_marker):
                ckpt.wait(remote=bool(args.remote))  # collective: every rank
                dist.barrier()  # every rank has looked at the marker
                if args.flip_copy and rank == 0:
                    flip(args.ckpt_dir, world - per_node * args.lost_nodes)
                if rank >= world - per_node * args.lost_nodes:  # the last nodes' ranks
                    open(args.kill_marker, "a").close()
                    if rank % per_node == per_node - 1:
                        os.kill(os.getppid(), signal.SIGKILL)  # the torchrun agent that started this worker
                    os.kill(os.getpid(), signal.SIGKILL)
    torch.save(
        {
            "model": local(model.state_dict()),
            "optimizer": local(optimizer.state_dict()),
            "seen": ckpt["seen"],
            **({"ballast": ckpt["ballast"]} if args.ballast_mb else {}),
        },
        f"{args.final}.rank{rank}.pt",
    )
    full = {
        name: value.full_tensor() if hasattr(value, "full_tensor") else value
        for name, value in model.state_dict().items()
    }
    if rank == 0:
        torch.save(full, f"{args.final}.full.pt")
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
