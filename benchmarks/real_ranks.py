"""What a real DDP job of N ranks sends per checkpoint and reads per restore, counted.

Usage: ``python benchmarks/real_ranks.py [N ...]`` (default: 2 4 8)

Runs ``tests/distributed/test_scale.py``'s jobs (real processes, gloo, 18 linear layers and AdamW) at each N
with that test's counters, which CI runs at N = 2 and 4: the bytes each rank sends and receives per
checkpoint, the size of ``manifest.json``, and, restoring from the one directory the ranks saved to
(taken for a network file system: no page cache shared), the data files and bytes each rank reads
and verifies, the bytes of replicated tensors the other ranks all-gather to it, and what it
receives point to point. Prints a Markdown table (docs/scale.md).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "distributed"), str(ROOT / "tests" / "scripts")]

import test_scale  # noqa: E402

from checkfreq.storage.format import DTYPES_BY_CODE, MANIFEST_NAME  # noqa: E402


def measure(world: int, tmp: Path) -> dict[str, float]:
    """One row: the commit counted over three checkpoints, then a counted restore of a fourth save."""
    commit = test_scale._commit_bytes(tmp, world, False)
    path = test_scale._save(tmp, world)
    manifest = json.loads((path / MANIFEST_NAME).read_bytes())
    replicated = sum(
        math.prod(e["shape"]) * DTYPES_BY_CODE[e["dtype"]].itemsize
        for e in manifest["distributed"]["tensors"].values()
        if e["kind"] == "replicated"
    )
    directory = str(tmp / f"ckpt{world}")
    mp.spawn(
        test_scale._restore_counted, args=(world, str(tmp / "store-restore"), directory, True), nprocs=world, join=True
    )
    restored = [torch.load(f"{directory}.restored{rank}.pt") for rank in range(world)]
    others = range(1, world)
    return {
        "N": world,
        "sent": statistics.median(commit[r]["sent"] for r in others),
        "received": statistics.median(commit[r]["received"] for r in others),
        "rank 0 received": commit[0]["received"],
        "manifest": (path / MANIFEST_NAME).stat().st_size,
        "files read": max(len(r["reads"]) for r in restored),
        "bytes read": statistics.median(sum(size for _, size in r["reads"]) for r in restored),
        "gathered / replicated": statistics.median(r["gathered"] for r in restored) / replicated,
        "orders received": max(r["received"] for r in restored),
    }


def main(worlds: list[int]) -> None:
    rows = []
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(measure(world, Path(tmp)))
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + " --- |" * len(rows[0]))
    for row in rows:
        print(
            "| "
            + " | ".join(f"{v:.3f}" if name.startswith("gathered") else f"{v:,.0f}" for name, v in row.items())
            + " |"
        )


if __name__ == "__main__":
    main([int(n) for n in sys.argv[1:]] or [2, 4, 8])
