"""Checkpoints written by earlier layouts of the package restore, bit for bit.

``tests/data/pre_layers`` was written by checkfreq 0.1.0 before its modules moved into layered
subpackages (``make_fixture.py`` there, run from that tree): a model with BatchNorm, AdamW, a step
scheduler, a ``ResumableLoader``, plain values and the ``Auto`` policy, saved at step 7, with what
the run held then (tensors, the next random numbers, the rest of the epoch's samples).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

import checkfreq as cf
from checkfreq.data import ResumableLoader
from helpers import ROOT

FIXTURE = ROOT / "tests" / "data" / "pre_layers"


def _objects() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR, ResumableLoader]:
    """The objects make_fixture.py registered, built as it built them (the same data set), then
    with other weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    dataset = torch.utils.data.TensorDataset(torch.randn(40, 6), torch.randint(0, 3, (40,)))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    return model, optimizer, scheduler, ResumableLoader(dataset, batch_size=4, shuffle=True, seed=7)


def test_a_checkpoint_written_before_the_layered_layout_restores_bit_for_bit(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(FIXTURE / "run", run)
    expected = load_file(str(FIXTURE / "expected.safetensors"))
    facts = json.loads((FIXTURE / "expected.json").read_text())
    model, optimizer, scheduler, loader = _objects()
    with cf.Checkpointer(
        run,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
        policy=cf.Auto(),
        keep=1,
        values={"best": 0.0, "tag": ""},
    ) as ckpt:
        assert ckpt.restore() == facts["step"] == ckpt.global_step
        rand = torch.rand(4)  # the RNG state restored is the one saved
        assert ckpt["best"] == facts["best"] and ckpt["tag"] == facts["tag"]
        assert scheduler.get_last_lr() == facts["lr"]
        assert loader.state_dict() == facts["next_batch"]
        for name, value in model.state_dict().items():
            assert torch.equal(value, expected[f"model/{name}"]), name
        for i, state in enumerate(optimizer.state.values()):
            assert torch.equal(state["exp_avg"], expected[f"optimizer/{i}/exp_avg"])
            assert torch.equal(state["exp_avg_sq"], expected[f"optimizer/{i}/exp_avg_sq"])
        assert torch.equal(rand, expected["rng/torch_rand"])
        # the rest of the epoch, in order
        assert torch.equal(torch.cat([x for x, _ in loader]), expected["data/rest_x"])
        assert ckpt.policy.overhead.warmup > 0  # the seeded Auto policy is usable
        x, y = next(iter(_objects()[3]))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ckpt.step(loss=loss.item())
        ckpt.save(blocking=True)  # and the run goes on checkpointing in the new layout
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("step_")) == ["step_000000008"]
