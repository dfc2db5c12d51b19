"""A data-parallel training run for the distributed acceptance tests.

Runs under ``torchrun`` (DDP over gloo) or as one plain process. Restores from ``--ckpt-dir`` if a
checkpoint is there, trains to the end (shuffled resumable loader, random augmentation, dropout,
BatchNorm, AdamW, an LR schedule) and every rank writes its final state to ``<final>.rank<r>.pt``.
Besides the model, each rank registers per-rank plain values: a tensor (``running``), a Python int
(``seen``) and a value that is a tensor on rank 0 and a float on the others (``mixed``).

* ``--broadcast-buffers 0``: DDP with ``forward_sync_buffers=False`` (every rank keeps its own
  BatchNorm statistics); by default rank 0's buffers are broadcast at each forward.
* ``--diverge``: rank 1 changes a weight after DDP synchronised them (the first checkpoint must fail).
* ``--on-error raise|warn``: the Checkpointer's ``on_error``.
* ``--dump DIR``: write each rank's model state and values right after the restore to
  ``DIR/restored-w<world>-r<rank>.pt`` and at ``--stop-at`` to ``DIR/stopped-w<world>-r<rank>.pt``.

* ``--die LIFE:RANK:STEP:MODE,...``: in incarnation LIFE (torchrun's ``TORCHELASTIC_RESTART_COUNT``),
  rank RANK SIGKILLs itself after optimizer step STEP: MODE ``step`` once the checkpoint in flight
  is durable, MODE ``persist`` right after the checkpoint that step decided is captured, while it is written.
* ``--stop-at K``: take a blocking checkpoint at step K and exit cleanly (to resume elsewhere).
* ``--attempt-store``: initialise the default process group on keys of its own for each restart attempt,
  as docs/distributed.md shows for torchrun's static launch form.
* ``--memory N``: the memory tier, a snapshot every N steps; ``--drop-region LIFE:RANK``: in
  incarnation LIFE, rank RANK deletes its memory-tier region before restoring (its node lost it).
* ``--remote URL|PATH``: a second tier (``--endpoint``: an S3-protocol server for ``s3://`` URLs),
  keeping as many checkpoints as the local one. ``--ckpt-dir`` is then the node's local tier: two
  torchrun agents ("nodes") may each pass their own. ``--wait-remote``: after each checkpoint, wait
  until it is in the remote tier (no upload is skipped: the kills below land on known steps).
* ``--kill-write RANK:N``: in the first incarnation, rank RANK writes part of its N-th data file
  into the local tier, then SIGKILLs itself (mid-persist).
* ``--kill-upload RANK:STEP``: in the first incarnation, rank RANK SIGKILLs itself when asked to
  upload its data file of checkpoint STEP to the remote tier (after the local commit).
  Each kill happens once: it leaves ``--kill-marker`` behind (a node whose agent did not see the
  failure restarts its workers with the same incarnation number).

Each rank appends its batches to ``--batch-log`` as ``rank epoch consumed index index ...``; a batch
replayed after a restore has the same (rank, epoch, consumed) key and replaces its earlier line.
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path, PurePath
from typing import Any

import torch
import torch.distributed as dist
from noisy_points import NoisyPoints  # beside this script
from torch import nn
from worker_exit import exit_without_teardown  # beside this script

from checkfreq import Checkpointer
from checkfreq.data import ResumableLoader
from checkfreq.storage import FsspecStore, LocalStore, Store
from checkfreq.storage.format import MANIFEST_NAME, checkpoint_name
from checkfreq.storage.shm_paths import region_path


def build_model() -> nn.Module:
    """Uneven layer sizes: the partition has to split tensors to balance the ranks."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 512),
        nn.BatchNorm1d(512),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(512, 64),
        nn.ReLU(),
        nn.Linear(64, 3),
    )


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--final", required=True)
    parser.add_argument("--batch-log", required=True)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--die", default="", help="LIFE:RANK:STEP:MODE,... (MODE: step or persist)")
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--broadcast-buffers", type=int, default=1)
    parser.add_argument("--dump", default=None)
    parser.add_argument("--diverge", action="store_true")
    parser.add_argument("--on-error", default="raise")
    parser.add_argument("--memory", type=int, default=0)
    parser.add_argument("--drop-region", default="")
    parser.add_argument("--remote", default=None)
    parser.add_argument("--endpoint", default=None)
    parser.add_argument("--wait-remote", action="store_true")
    parser.add_argument("--kill-write", default="", help="RANK:N")
    parser.add_argument("--kill-upload", default="", help="RANK:STEP")
    parser.add_argument("--kill-marker", default=None)
    parser.add_argument("--attempt-store", action="store_true")
    return parser.parse_args()


def open_remote(args: argparse.Namespace) -> Store | str | None:
    """The remote tier: an S3 store with the test server's options, else the path as users pass it
    (a store object where a kill hook wraps its writes)."""
    if args.remote and args.endpoint:
        return FsspecStore(args.remote, endpoint_url=args.endpoint, key="testing", secret="testing")
    return LocalStore(args.remote) if args.remote and args.kill_upload else args.remote


def first_kill(args: argparse.Namespace, spec: str, rank: int) -> Callable[[], bool] | None:
    """For this rank's ``RANK:X`` kill spec, a check that says "kill now" at most once; else None."""
    if not spec or int(spec.split(":")[0]) != rank or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    marker = Path(args.kill_marker)

    def once() -> bool:
        if marker.exists():
            return False
        marker.write_text(f"rank {rank} pid {os.getpid()}\n")
        return True

    return once


def kill_mid_local_write(local_dir: str, n: int, once: Callable[[], bool]) -> None:
    """SIGKILL this process in the middle of its ``n``-th data-file write into ``local_dir``."""
    original, root, seen = LocalStore.write_file, Path(local_dir).resolve(), 0

    def write_file(self: LocalStore, staging: Path, name: str, chunks: Iterable[bytes | memoryview]) -> None:
        nonlocal seen
        if name != MANIFEST_NAME and Path(staging).resolve().is_relative_to(root):
            seen += 1
            if seen == n and once():
                chunks = die_after_first(chunks)
        original(self, staging, name, chunks)

    LocalStore.write_file = write_file  # type: ignore[method-assign]


def die_after_first(chunks: Iterable[bytes | memoryview]) -> Iterator[bytes | memoryview]:
    """The first chunk, then a SIGKILL when the writer asks for more: a file half written."""
    for chunk in chunks:
        yield chunk
        break
    os.kill(os.getpid(), signal.SIGKILL)


def kill_before_upload(remote: Any, step: int, once: Callable[[], bool]) -> None:
    """SIGKILL this process when ``remote`` is asked to store this rank's data file of checkpoint ``step``."""
    original = remote.write_file

    def write_file(staging: Any, name: str, chunks: Iterable[bytes | memoryview]) -> None:
        if name != MANIFEST_NAME and PurePath(str(staging)).name.startswith(checkpoint_name(step)) and once():
            os.kill(os.getpid(), signal.SIGKILL)
        original(staging, name, chunks)

    remote.write_file = write_file


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    # built before the process group exists, as Lightning does: it must still partition by rank
    loader = ResumableLoader(NoisyPoints(args.samples), batch_size=args.batch_size, shuffle=True, seed=5)
    distributed = "RANK" in os.environ
    if distributed and args.attempt_store:
        init_for_this_attempt()
    elif distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    die_at, die_mode = None, "step"
    for spec in filter(None, args.die.split(",")):
        when, who, at, mode = spec.split(":")
        if int(when) == life and int(who) == rank:
            die_at, die_mode = int(at), mode

    model = build_model()
    world = dist.get_world_size() if distributed else 1
    sync = {} if args.broadcast_buffers else {"forward_sync_buffers": False}
    net = nn.parallel.DistributedDataParallel(model, **sync) if distributed else model
    if args.diverge and rank == 1:  # a parameter DDP no longer keeps in step: checkfreq must refuse it
        with torch.no_grad():
            model[0].weight[0, 0] += 1.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.8)
    if args.drop_region == f"{life}:{rank}":
        region_path(args.ckpt_dir, rank).unlink()
    remote = open_remote(args)
    if once := first_kill(args, args.kill_write, rank):
        kill_mid_local_write(args.ckpt_dir, int(args.kill_write.split(":")[1]), once)
    if once := first_kill(args, args.kill_upload, rank):
        kill_before_upload(remote, int(args.kill_upload.split(":")[1]), once)
    ckpt = Checkpointer(
        args.ckpt_dir,
        policy=args.every,
        keep=2,
        remote=remote,
        on_error=args.on_error,
        memory=args.memory or False,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
    )
    ckpt["running"] = torch.full((8,), float(rank)) + torch.arange(8) / 10
    ckpt["seen"] = 0
    ckpt["mixed"] = torch.zeros(3) if rank == 0 else 0.5
    step = ckpt.restore()
    state = loader.state_dict()
    print(
        f"life={life} rank={rank} restored step={step} epoch={state['epoch']} consumed={state['consumed']}\n",
        end="",
        flush=True,
    )  # one write, newline included: the ranks share the agent's stdout
    if args.dump:
        torch.save(per_rank_state(model, ckpt), f"{args.dump}/restored-w{world}-r{rank}.pt")

    with open(f"{args.batch_log}", "a") as log:
        for epoch in range(loader.epoch, args.epochs):
            for x, y, index in loader:
                log.write(f"{rank} {epoch} {loader.state_dict()['consumed']} {' '.join(map(str, index.tolist()))}\n")
                log.flush()
                loss = nn.functional.cross_entropy(net(x), y)
                ckpt["running"] = ckpt["running"] * 0.5 + loss.detach()
                ckpt["seen"] += int(index.sum())
                ckpt["mixed"] = ckpt["mixed"] + (
                    loss.detach() if isinstance(ckpt["mixed"], torch.Tensor) else loss.item()
                )
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                scheduler.step()
                started = ckpt.step()
                if started and args.wait_remote:
                    ckpt.wait(remote=True)
                if ckpt.global_step == die_at:
                    if die_mode == "step":
                        ckpt.wait()
                    else:
                        assert started, "MODE persist needs a checkpoint step"
                        ckpt.consistent_point()  # captured now (after the previous persist): its write begins
                    os.kill(os.getpid(), signal.SIGKILL)
                if ckpt.global_step == args.stop_at:
                    ckpt.save(blocking=True)
                    if args.dump:
                        torch.save(per_rank_state(model, ckpt), f"{args.dump}/stopped-w{world}-r{rank}.pt")
                    finish(ckpt, distributed)
                    return
    finish(ckpt, distributed)
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": torch.get_rng_state(),
            **per_rank_state(model, ckpt)["values"],
        },
        Path(args.final).with_suffix(f".rank{rank}.pt"),
    )


def init_for_this_attempt() -> None:
    """The default process group, its rendezvous keys apart from any earlier attempt's (docs/distributed.md)."""
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"attempt-{attempt}", agent_store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )


def per_rank_state(model: nn.Module, ckpt: Checkpointer) -> dict:
    """What may differ between ranks: the BatchNorm buffers and the plain values."""
    return {
        "buffers": {k: v.clone() for k, v in model.named_buffers()},
        "values": {k: ckpt[k] for k in ("running", "seen", "mixed")},
    }


def finish(ckpt: Checkpointer, distributed: bool) -> None:
    ckpt.close()
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
