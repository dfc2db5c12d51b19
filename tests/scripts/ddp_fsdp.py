"""FSDP2 round trip under ``torchrun --nproc-per-node 2`` (CPU, gloo).

Trains a ``fully_shard`` model (uneven shards: 33 rows over 2 ranks) with Adam, checkpoints it,
then restores into a freshly built FSDP2 model and optimizer (other initial weights, no optimizer
state yet) and checks that every parameter and optimizer tensor matches, shard by shard, and that
one more training step gives identical weights. Then checks that a policy answering differently
on the two ranks still makes both checkpoint at the same step. Rank 0 saves the full (gathered) state to
``--expect`` for the test to compare a world-size-1 restore against.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from worker_exit import exit_without_teardown  # beside this script

from checkfreq import Checkpointer, DecisionContext


class OnlyRankOneAtStep2:
    """A policy whose answer depends on the rank: the ranks must still agree."""

    def should_save(self, ctx: DecisionContext) -> bool:
        return dist.get_rank() == 1 and ctx.step == 2


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(7, 33), nn.ReLU(), nn.Linear(33, 5))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    generator = torch.Generator().manual_seed(100 * step + dist.get_rank())
    loss = model(torch.randn(6, 7, generator=generator)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor gathered to its global value, by a stable name."""
    out = {f"model/{k}": v.full_tensor() for k, v in model.state_dict().items()}
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            out[f"optimizer/{index}/{key}"] = value.full_tensor() if hasattr(value, "full_tensor") else value
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--expect", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    model, optimizer = build(seed=0)
    with Checkpointer(args.ckpt_dir, policy=1000, model=model, optimizer=optimizer) as ckpt:
        for step in range(1, 4):
            train(model, optimizer, step)
            ckpt.step()
        ckpt.save(blocking=True)
    expected = full_state(model, optimizer)
    if rank == 0:
        torch.save(expected, args.expect)

    restored_model, restored_optimizer = build(seed=1)
    with Checkpointer(args.ckpt_dir, policy=1000, model=restored_model, optimizer=restored_optimizer) as ckpt:
        assert ckpt.restore() == 3
    got = full_state(restored_model, restored_optimizer)
    assert got.keys() == expected.keys(), (sorted(got), sorted(expected))
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    for (name, live), (_, back) in zip(model.state_dict().items(), restored_model.state_dict().items(), strict=True):
        assert back.placements == live.placements and torch.equal(back.to_local(), live.to_local()), name

    train(model, optimizer, 4)
    train(restored_model, restored_optimizer, 4)
    for name, value in full_state(model, optimizer).items():
        assert torch.equal(full_state(restored_model, restored_optimizer)[name], value), f"after a step: {name}"
    agree_dir = f"{args.ckpt_dir}-agree"
    with Checkpointer(agree_dir, policy=OnlyRankOneAtStep2(), model=model, optimizer=optimizer) as ckpt:
        started = []
        for step in range(5, 9):
            train(model, optimizer, step)
            started.append(ckpt.step())
    assert started == [False, False, True, False], started  # asked at step 2, taken at step 3 by both
    assert sorted(os.listdir(agree_dir)) == [".checkfreq.lock", "events.jsonl", "step_000000003"]

    local_rows = model[0].weight.to_local().shape[0]
    print(
        f"rank={rank} fsdp round trip ok local_rows={local_rows} "
        f"files={sorted(os.listdir(ckpt.directory / 'step_000000003'))}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
