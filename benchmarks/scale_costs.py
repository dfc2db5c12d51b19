"""How the per-checkpoint, per-restore and start-up messages and the manifest grow with the number of ranks.

Usage: ``python benchmarks/scale_costs.py [--worlds 1,2,4,64,1024,16384]``

Computed with checkfreq's own code on synthetic inputs, in one process (no ranks are started): for
each world size N, the plan every rank computes (:class:`checkfreq.ranks.group_cluster.SharePlan`), one rank's
commit report as :class:`checkfreq.pipeline.save.commit.Committer` builds it, the manifest rank 0 writes
(:func:`checkfreq.pipeline.save.commit.merge`), each rank's record in its data file's header, the directory
directory key each rank all-gathers at start (:mod:`checkfreq.ranks.sharing`), and what each rank all-gathers
at restore. Two states:

* ``ddp``: 18 linear layers of 32x32 and AdamW (36 parameters, 108 optimizer state tensors, all
  replicated) and 4 private random-generator tensors per rank, as in ``tests/distributed/test_scale.py``;
* ``fsdp2``: the same tensors, every parameter and state tensor a DTensor sharded over the N ranks.

Prints one JSON line per (state, N) and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from checkfreq.pipeline.save.commit import CommitReport, agreement_digest, merge
from checkfreq.ranks import replicas
from checkfreq.ranks.group_cluster import SharePlan
from checkfreq.ranks.shares import PRIVATE, REPLICATED, SHARDED, private_name
from checkfreq.ranks.sharing import directory_key
from checkfreq.storage.format import DTYPE_CODES, data_file_name, encode_header, plan_layout

LAYERS = 18
PRIVATE_TENSORS = {
    "rng/torch": (torch.uint8, (5056,)),
    "rng/numpy": (torch.uint32, (624,)),
    "rng/python": (torch.int64, (625,)),
    "rng/cuda": (torch.uint8, (0,)),
}


def replicated_state(layers: int = LAYERS) -> dict[str, torch.Tensor]:
    """The parameters of ``layers`` linear layers and AdamW's state (8 tensors a layer), by the names checkfreq gives
    them."""
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        for index, (kind, shape) in enumerate((("weight", (32, 32)), ("bias", (32,)))):
            position = 2 * layer + index
            tensors[f"model/{layer}.{kind}"] = torch.zeros(shape)
            tensors[f"optimizer/state/{position}/exp_avg"] = torch.zeros(shape)
            tensors[f"optimizer/state/{position}/exp_avg_sq"] = torch.zeros(shape)
            tensors[f"optimizer/state/{position}/step"] = torch.zeros(())
    return tensors


def skeleton(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A skeleton of the size :func:`checkfreq.run.state.flatten` gives this state (a reference per tensor)."""
    refs = {name: {"__tensor__": name} for name in [*tensors, *PRIVATE_TENSORS]}
    groups = [
        {
            "lr": 0.001,
            "betas": [0.9, 0.999],
            "eps": 1e-8,
            "weight_decay": 0.01,
            "amsgrad": False,
            "params": list(range(len(tensors) // 4)),
        }
    ]
    return {"refs": refs, "optimizer": {"param_groups": groups}, "checkfreq": {"profile": {"iteration_s": 0.01}}}


def costs(world: int, state: str, layers: int = LAYERS) -> dict[str, Any]:
    tensors = replicated_state(layers)
    names = sorted(tensors)
    if state == "ddp":
        layout = tuple((n, str(tensors[n].dtype), tuple(tensors[n].shape)) for n in names)
        plan = SharePlan.of(layout, {n: tensors[n] for n in names}, world, 0)
        shared = dict(plan.shared)
        own = {}
        arrays = {p.stored_name: (tensors[p.name].dtype, (p.end - p.begin,)) for p in plan.pieces}
        claim = replicas.report(layout, {n: "0123456789abcdef" for n in names})
    else:  # every tensor a DTensor sharded on dim 0 (one element per rank at least)
        layout, plan = (), None
        shared, own, arrays = {}, {}, {}
        for name, t in tensors.items():
            rows = -(-t.shape[0] // world) if t.dim() else 1
            entry = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape), "kind": SHARDED}
            shared[name] = {**entry, "parts": []}
            own[name] = {**entry, "parts": [[private_name(name, 0), [0] * t.dim()]]}
            arrays[private_name(name, 0)] = (t.dtype, (min(rows, t.shape[0]), *t.shape[1:]) if t.dim() else ())
        claim = replicas.report(layout, {})
    for name, (dtype, shape) in PRIVATE_TENSORS.items():
        own[name] = {
            "dtype": DTYPE_CODES[dtype],
            "shape": list(shape),
            "kind": PRIVATE,
            "parts": [private_name(name, 0)],
        }
        arrays[private_name(name, 0)] = (dtype, shape)
    share = {
        "rank": own,
        "shared": shared,
        "replicas": claim,
        "plan": None if plan is None else plan.digest,
        "later": {},
    }
    reports = [
        CommitReport(
            rank=r,
            created=1.8e9,
            ok=True,
            file=data_file_name(r),
            size=2**40,
            xxh3_64="0123456789abcdef",
            upload_idle=True,
            agree=agreement_digest(share),
            directory_leader=r,
            leader=False,
        )
        for r in range(world)
    ]
    report = reports[-1].to_wire()
    manifest = merge(reports, 10**8, 10**4, {"checkfreq": "0.0.0", "torch": "2.13.0", "python": "3.12.0"}, share)
    header = encode_header(plan_layout(arrays), {"state": skeleton(tensors), "tensors": own})
    identity = directory_key(Path("."))
    restore_note = {"steps": {str(10**8): {"held": [data_file_name(world - 1)], "remote": True}}, "listed": 3}
    return {
        "state": state,
        "world": world,
        "report_bytes": len(json.dumps(report)),
        **commit_messages(world, report),
        "manifest_bytes": len(manifest.to_json()),
        "header_bytes": len(header),
        "identity_bytes": len(json.dumps(identity)),
        "restore_note_bytes": len(json.dumps(restore_note)),
        "replicated_pieces": sum(len(e["parts"]) for e in shared.values() if e["kind"] == REPLICATED),
    }


def commit_messages(world: int, report: dict[str, Any]) -> dict[str, int]:
    """Bytes one rank other than 0 sends and receives per checkpoint, and rank 0 receives, in the
    three rounds of :class:`checkfreq.pipeline.save.commit.Committer` (each message: an 8-byte length, then its
    JSON); and, for comparison, what each rank received when every round was an all-gather."""

    def size(value: Any) -> int:
        return 8 + len(json.dumps(value))

    sent = size(None) + size(report) + size(None)  # prepare, report, outcome: gathered on rank 0
    received = size([]) + size({"upload": True}) + size([])  # the verdicts rank 0 broadcasts
    return {
        "rank_sends": sent,
        "rank_receives": received,
        "rank0_receives": (world - 1) * sent,
        "all_gather_receives": world * (size({"ok": True}) + size(report) + size({"rank": world - 1, "ok": True})),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", default="1,2,4,64,1024,16384")
    args = parser.parse_args()
    rows = [costs(world, state) for state in ("ddp", "fsdp2") for world in map(int, args.worlds.split(","))]
    for row in rows:
        print(json.dumps(row))
    print(
        "\n| state | N | report | a rank sends / receives | rank 0 receives | (all-gathers) | manifest.json "
        "| data file header | identity | restore note |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['state']} | {r['world']} | {r['report_bytes']} B | {r['rank_sends']} B / {r['rank_receives']} B | "
            f"{r['rank0_receives']:,} B | {r['all_gather_receives']:,} B | "
            f"{r['manifest_bytes']:,} B | {r['header_bytes']:,} B | {r['identity_bytes']} B | "
            f"{r['restore_note_bytes']} B |"
        )


if __name__ == "__main__":
    main()
