"""The memory tier under DDP on one machine: shared memory used, the snapshot's cost, and the restore.

For each number of ranks the script runs itself under ``torchrun`` (CPU, gloo): every rank holds
the same data-parallel state (an MLP and its AdamW state, ``--mb`` MB in all), takes a memory
snapshot at each of ``--steps`` steps (no persist), and leaves without closing, as a killed job
does; then a second job restores from those snapshots. Printed per world size: the bytes of the
job's regions in shared memory, each rank's snapshot size, the median stall of a memory snapshot
(what the training thread waited) and of its background commit (copy and checksum), and the
slowest rank's ``restore()``. With ``--nodes 2`` each job runs as two torchrun agents on this
machine, each with its own shared memory (``CHECKFREQ_SHM_DIR``), as two nodes, and ``--replicas 1``
copies each snapshot to the other one (the copies' time, and each rank's bytes sent per snapshot,
are printed too).

    python -m benchmarks.memory_group --ranks 2,4 --mb 100
    python -m benchmarks.memory_group --ranks 4 --nodes 2 --replicas 0,1

Run it with ``PYTHONPATH`` pointing at another checkout's ``src`` to compare two versions.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import checkfreq as cf
from checkfreq.run.events import read_events
from checkfreq.storage.shm_paths import SHM_DIR_ENV


def _model(mb: float) -> nn.Module:
    """An MLP whose parameters and AdamW state (three copies) take about ``mb`` MB."""
    width = int((mb * 1e6 / 4 / 3 / 4) ** 0.5)
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(4)))


def worker(directory: str, mb: float, steps: int, restore: bool, replicas: int) -> None:
    dist.init_process_group("gloo")
    model = _model(mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p) * 1e-3
    ckpt = cf.Checkpointer(
        directory, policy=cf.Every(n=10**9), memory=1, replicas=replicas, model=model, optimizer=optimizer
    )
    if restore:
        ckpt.restore()
        os._exit(0)
    for _ in range(steps):
        optimizer.step()
        ckpt.step()
    ckpt.wait()
    dist.barrier()
    os._exit(0)  # as a killed job: the regions stay


def _torchrun(ranks: int, nodes: int, shm: list[str], work: list[str], *args: str) -> None:
    """The job on ``nodes`` agents of ``ranks // nodes`` ranks, agent ``i`` with ``shm[i]`` and ``work[i]``."""
    port = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{port.getsockname()[1]}"
    port.close()
    agents = []
    for node in range(nodes):
        launch = (
            ["--standalone"]
            if nodes == 1
            else [
                "--nnodes",
                str(nodes),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                address,
                "--local-addr",
                f"127.0.0.{node + 1}",
            ]
        )
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *launch,
            f"--nproc-per-node={ranks // nodes}",
            "-m",
            "benchmarks.memory_group",
            "--worker",
            "--dir",
            work[node],
            *args,
        ]
        env = {**os.environ, SHM_DIR_ENV: shm[node], "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        agents.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for agent in agents:
        _, err = agent.communicate(timeout=600)
        if agent.returncode:
            raise RuntimeError(err.decode()[-3000:])


def measure(ranks: int, mb: float, steps: int, nodes: int = 1, replicas: int = 0) -> dict[str, Any]:
    """One job of ``ranks`` ranks taking ``steps`` memory snapshots, then one restoring from them."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm_root, tempfile.TemporaryDirectory() as root:
        shm = [f"{shm_root}/node{n}" for n in range(nodes)]
        work = [f"{root}/node{n}" for n in range(nodes)]
        for path in (*shm, *work):
            os.mkdir(path)
        common = ("--mb", str(mb), "--replicas", str(replicas))
        _torchrun(ranks, nodes, shm, work, *common, "--steps", str(steps))
        regions = sum(p.stat().st_size for node in shm for p in Path(node).iterdir())
        _torchrun(ranks, nodes, shm, work, *common, "--restore")
        events = [e for node in work for e in read_events(node)]
    taken = [e for e in events if e["event"] == "memory"]
    copies = [e for e in events if e["event"] == "replica" and e["kept"]]
    return {
        "ranks": ranks,
        "nodes": nodes,
        "replicas": replicas,
        "regions_bytes": regions,
        "snapshot_bytes": sorted({e["rank"]: e["bytes"] for e in taken}.values()),
        "stall_ms": 1e3 * statistics.median(e["stall_s"] for e in taken[ranks:]),  # the first creates the region
        "copies": len(copies),
        "copy_ms": 1e3 * statistics.median(e["seconds"] for e in copies) if copies else None,
        "copy_bytes": sorted({e["rank"]: e["bytes"] for e in copies}.values()),  # what one snapshot's copy sent
        "restore_s": max(e["restore_s"] for e in events if e["event"] == "restore"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--mb", type=float, default=100)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--replicas", default="0", help="comma-separated: each value a job of its own")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--restore", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.dir, args.mb, args.steps, args.restore, int(args.replicas))
        return
    start = time.perf_counter()
    for _ in range(args.rounds):
        for ranks in (int(r) for r in args.ranks.split(",")):
            for replicas in (int(r) for r in args.replicas.split(",")):
                print(json.dumps(measure(ranks, args.mb, args.steps, args.nodes, replicas)), flush=True)
    print(f"# {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
