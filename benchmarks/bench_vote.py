"""How long one vote on when to checkpoint takes: the ring all-reduce of before against the tree.

Usage: ``python benchmarks/bench_vote.py [--ranks 2,4,8] [--repeats 200]``

For each number of ranks, real processes (CPU, gloo, one torch thread each) time, in alternation,
the two ways of taking the maximum of every rank's ``(wanted, −proposal)``:

* ``ring``: a MAX all-reduce on a gloo group whose pairs all connect at creation (the exchange of
  the previous version);
* ``tree``: :func:`checkfreq.ranks.collectives.tree_max` over a group connected on first message (the
  exchange now, which the vote thread runs).

Each repeat starts on every rank after a barrier on the default group; a rank's time is from its
start to its result. Prints, per number of ranks, the median over repeats of the slowest rank's time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from checkfreq.ranks.collectives import GroupPeers, tree_max
from checkfreq.ranks.compat import default_store, gloo_group_on_store


def _rank(rank: int, world: int, store_path: str, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    ring = dist.new_group(backend="gloo")
    tree = GroupPeers(
        gloo_group_on_store(dist.PrefixStore("bench_vote", default_store()), timedelta(seconds=60), "bench:vote")
    )
    value = torch.tensor([rank % 2, -rank - 1], dtype=torch.int64)
    exchanges = {
        "ring": lambda: dist.all_reduce(value.clone(), op=dist.ReduceOp.MAX, group=ring, async_op=True).wait(),
        "tree": lambda: tree_max(tree, value),
    }
    times: dict[str, list[float]] = {name: [] for name in exchanges}
    for i in range(repeats + 5):  # the first 5 of each connect and warm up
        for name, exchange in exchanges.items() if i % 2 else reversed(exchanges.items()):
            dist.barrier()
            start = time.perf_counter()
            exchange()
            if i >= 5:
                times[name].append(time.perf_counter() - start)
    slowest = {name: [0.0] * repeats for name in times}
    for name, mine in times.items():
        gathered = [torch.zeros(repeats, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(gathered, torch.tensor(mine, dtype=torch.float64))
        slowest[name] = torch.stack(gathered).max(dim=0).values.tolist()
    if rank == 0:
        Path(out).write_text(json.dumps(slowest))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    print("| ranks | ring all-reduce (before) | tree (now) |")
    print("| --- | --- | --- |")
    for world in map(int, args.ranks.split(",")):
        with tempfile.TemporaryDirectory() as work:
            out = str(Path(work, "times"))
            mp.spawn(_rank, args=(world, str(Path(work, "store")), args.repeats, out), nprocs=world, join=True)
            slowest = json.loads(Path(out).read_text())
        ring, tree = (statistics.median(slowest[name]) * 1e3 for name in ("ring", "tree"))
        print(f"| {world} | {ring:.2f} ms | {tree:.2f} ms |", flush=True)


if __name__ == "__main__":
    main()
