"""Distributed checkpointing: checkfreq vs torch.distributed.checkpoint (DCP), world size 1 and 2.

Usage: ``python benchmarks/bench_distributed.py [--mb 128] [--rounds 5] [--dir DIR] [--remote DIR]``

For each world size the script runs itself under ``torchrun`` (CPU, gloo); every worker holds
the same data-parallel state (an MLP with uneven layers and its Adam state) and, round after round,
saves it with each method in a rotating order (A B C, B C A, ...):

* ``checkfreq``: ``Checkpointer.save()``; the *stall* is until training could go on (``save()``
  returns and the next ``optimizer.step()`` passes the fence), *durable* is until ``wait()`` returns
  on every rank (files fsynced, manifest committed);
* ``dcp.save``: blocking; stall = durable;
* ``dcp.async_save`` (thread executor): stall until it returns, durable until its future is done;
* ``checkfreq+remote`` (with ``--remote DIR``): a second ``Checkpointer`` whose local directory is
  per rank (as node-local disks are) and whose ``remote=`` tier is ``DIR`` (a plain directory, shared
  by the ranks); stall and durable as for ``checkfreq`` (``wait()``: committed in the local tier),
  *remote* until ``wait(remote=True)`` returns on every rank (every rank's file copied and verified,
  the remote manifest written).

It also times getting the bytes of a checkpoint onto every rank two ways: every rank reads (and
verifies) every file, what checkfreq does, against each rank reading its own file and broadcasting
it to the others over a gloo group; and a whole ``restore()`` (choice, read, load into the objects).

Prints medians with their spread (min-max) and the ratios; aggregate bandwidth is the state size
over the slowest rank's durable time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

METHODS = ("checkfreq", "dcp.save", "dcp.async_save")
REMOTE = "checkfreq+remote"


def build(mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Uneven layers, ``mb`` MB of parameters plus Adam state in all (4 bytes x 3 per parameter)."""
    torch.manual_seed(0)
    width = int((mb * 1e6 / 12 / 3.2) ** 0.5)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width // 2), torch.nn.Linear(width // 2, 3)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    for p in model.parameters():
        p.grad = None  # optimizer.step() now only passes the checkpoint fence
    return model, optimizer


def worker(args: argparse.Namespace) -> None:
    import torch.distributed.checkpoint as dcp

    from checkfreq import Checkpointer
    from checkfreq.storage.posix import read_data_file, read_manifest

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(args.dir)
    model, optimizer = build(args.mb)
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values())
    ckpt = Checkpointer(root / "checkfreq", policy=10**9, keep=1, rng=False, model=model, optimizer=optimizer)
    tiered = (
        None
        if args.remote is None
        else Checkpointer(
            root / "checkfreq-local" / f"rank{rank}",
            remote=Path(args.remote),
            policy=10**9,
            keep=1,
            rng=False,
            model=model,
            optimizer=optimizer,
        )
    )
    methods = METHODS if tiered is None else (*METHODS, REMOTE)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    results: dict[str, dict[str, list[float]]] = {m: {"stall": [], "durable": [], "remote": []} for m in methods}

    def slowest(seconds: float) -> float:
        value = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value.item())

    def run(method: str, round_: int) -> tuple[float, float, float]:
        dist.barrier()
        start = time.perf_counter()
        remote = float("nan")
        if method in ("checkfreq", REMOTE):
            saver = ckpt if method == "checkfreq" else tiered
            saver.save()
            optimizer.step()  # the fence: training goes on only once the snapshot is copied
            stall = time.perf_counter() - start
            saver.wait()
            if method == REMOTE:
                durable = time.perf_counter() - start
                saver.wait(remote=True)  # collective: every rank's copy confirmed, the remote manifest written
                return stall, slowest(durable), slowest(time.perf_counter() - start)
        elif method == "dcp.save":
            dcp.save(state, checkpoint_id=str(root / f"dcp{round_}"))
            stall = time.perf_counter() - start
        else:
            future = dcp.async_save(state, checkpoint_id=str(root / f"dcpa{round_}"))
            stall = time.perf_counter() - start
            future.result()
        return stall, slowest(time.perf_counter() - start), remote

    for round_ in range(-1, args.rounds):  # round -1 warms up every method
        for i in range(len(methods)):
            method = methods[(i + max(round_, 0)) % len(methods)]
            optimizer.step()  # no gradients: changes nothing; step() follows an optimizer step, as in training
            for checkpointer in filter(None, (ckpt, tiered)):
                checkpointer.step()  # a new step each time, as in training (the policies never fire)
            stall, durable, remote = run(method, round_)
            if round_ >= 0:
                results[method]["stall"].append(stall)
                results[method]["durable"].append(durable)
                results[method]["remote"].append(remote)
        dist.barrier()
        if rank == 0:
            for path in root.glob("dcp*"):
                shutil.rmtree(path)

    restore: dict[str, list[float]] = {
        "read every file": [],
        "read own file + gloo broadcast": [],
        "whole restore()": [],
    }
    newest = max((root / "checkfreq").glob("step_*"))
    group = dist.new_group(backend="gloo")
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        files = read_manifest(newest).files
        for name, entry in sorted(files.items()):
            read_data_file(newest / name, entry["size"], entry["xxh3_64"])
        restore["read every file"].append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        ckpt.restore()
        restore["whole restore()"].append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        files = read_manifest(newest).files
        for r, (name, entry) in enumerate(sorted(files.items())):
            data = read_data_file(newest / name, entry["size"], entry["xxh3_64"])[0] if r == rank else None
            size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)
            dist.broadcast(size, src=r, group=group)
            buffer = data if data is not None else torch.empty(int(size.item()), dtype=torch.uint8)
            dist.broadcast(buffer, src=r, group=group)
        restore["read own file + gloo broadcast"].append(time.perf_counter() - start)
    ckpt.close()
    if tiered is not None:
        tiered.close()
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"rank": rank, "results": results})
    if rank == 0:
        print(
            "RESULT " + json.dumps({"world": world, "bytes": nbytes, "ranks": per_rank, "restore": restore}), flush=True
        )
    dist.destroy_process_group()


def launch(world: int, mb: int, rounds: int, directory: Path, remote: Path | None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        __file__,
        "--worker",
        "--mb",
        str(mb),
        "--rounds",
        str(rounds),
        "--dir",
        str(directory),
    ]
    if remote is not None:
        command += ["--remote", str(remote)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"world size {world} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[0][len("RESULT ") :])


def summary(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:8.1f} ms ({min(values) * 1e3:.1f}-{max(values) * 1e3:.1f})"


def report(runs: list[dict]) -> None:
    medians: dict[tuple[int, str], tuple[float, float]] = {}
    for run in runs:
        world, gb = run["world"], run["bytes"] / 1e9
        print(f"\nworld size {world}: {run['bytes'] / 1e6:.0f} MB of replicated state")
        print(f"  {'method':16} {'stall per rank, median (min-max)':36} {'durable (slowest rank)':30} aggregate GB/s")
        methods = [m for m in (*METHODS, REMOTE) if m in run["ranks"][0]["results"]]
        for method in methods:
            stalls = [s for r in run["ranks"] for s in r["results"][method]["stall"]]
            durable = run["ranks"][0]["results"][method]["durable"]
            medians[(world, method)] = (statistics.median(stalls), statistics.median(durable))
            print(f"  {method:16} {summary(stalls):36} {summary(durable):30} {gb / statistics.median(durable):6.2f}")
        if REMOTE in methods:
            remote = run["ranks"][0]["results"][REMOTE]["remote"]
            print(
                f"  {'  remote tier':16} {'(wait(remote=True), slowest rank)':36} {summary(remote):30} "
                f"{gb / statistics.median(remote):6.2f}"
            )
        for way, values in run["restore"].items():
            print(f"  restore, {way:32} {summary(values)}")
    print("\nratios (median / checkfreq median, same world size):")
    for world in sorted({w for w, _ in medians}):
        base_stall, base_durable = medians[(world, "checkfreq")]
        for method in [m for m in (*METHODS[1:], REMOTE) if (world, m) in medians]:
            stall, durable = medians[(world, method)]
            print(
                f"  world {world} {method:16} stall x{stall / base_stall:5.1f}   durable x{durable / base_durable:5.2f}"
            )
    if {(1, "checkfreq"), (2, "checkfreq")} <= medians.keys():
        for method in METHODS:
            print(f"  {method:16} durable world 2 / world 1: x{medians[(2, method)][1] / medians[(1, method)][1]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--remote", default=None, help=f"add the {REMOTE} row, with this directory as the remote tier")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    base = Path(args.dir or tempfile.mkdtemp(prefix="cf-bench-dist-"))
    runs = []
    for world in (1, 2):
        directory = base / f"world{world}"
        remote = None if args.remote is None else Path(args.remote) / f"world{world}"
        for path in filter(None, (directory, remote)):
            shutil.rmtree(path, ignore_errors=True)
        runs.append(launch(world, args.mb, args.rounds, directory, remote))
        for path in filter(None, (directory, remote)):
            shutil.rmtree(path, ignore_errors=True)
    report(runs)


if __name__ == "__main__":
    main()
