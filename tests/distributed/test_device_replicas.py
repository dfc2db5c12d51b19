"""Two gloo ranks whose replicated state lives on a (fake) device: the replica claim's fingerprints are
of the bytes the device holds in stream order, taken from the snapshot's copies, and a real
difference between the ranks still stops the commit (checkfreq.ranks.replicas)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import checkfreq as cf
from checkfreq.pipeline.capture.snapshot import Snapshotter
from fake_device import FakeDevice
from helpers import spawn_ranks


def _ranks(rank: int, store: str, directory: str, out: str, diverge: bool) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    gpu = FakeDevice()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    for param in model.parameters():  # the parameters live in the fake device's memory
        param.data = gpu.tensor(param.detach().clone())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result = "committed"
    try:
        with cf.Checkpointer(
            directory, policy=1000, persist_timeout=60, failure_timeout=10, model=model, optimizer=opt
        ) as ckpt:
            ckpt._saver.snapshotter = Snapshotter(ops=gpu)
            for _ in range(2):
                model(torch.ones(4, 64)).sum().backward()
                opt.step()
                opt.zero_grad()
                ckpt.step()
            if diverge and rank == 1:  # a kernel queued before the snapshot that the GPU has not run yet
                gpu.launch(gpu.training, lambda: model.weight.data[5, 7].add_(1.0), "a late kernel")
            ckpt.save(blocking=True)
    except cf.ReplicaMismatchError as e:
        result = str(e)
    Path(f"{out}.{rank}").write_text(result)
    dist.destroy_process_group()


@pytest.mark.parametrize("diverge", [False, True])
def test_device_state_is_verified_in_stream_order_and_a_difference_still_stops_the_commit(
    tmp_path: Path, diverge: bool
) -> None:
    directory = tmp_path / "run"
    spawn_ranks(_ranks, (str(tmp_path / "store"), str(directory), str(tmp_path / "out"), diverge), 2)
    results = [(tmp_path / f"out.{rank}").read_text() for rank in range(2)]
    if not diverge:
        assert results == ["committed", "committed"]
        assert [p.name for p in directory.glob("step_*")]
        return
    for result in results:
        assert "checkpoint 2 not committed: ranks disagree" in result
        assert "'model/weight' holds 2 different values, on ranks [0] and [1]" in result
    assert not list(directory.glob("step_*"))
