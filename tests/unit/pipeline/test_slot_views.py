"""The memory tier's views of a slot, made once per slot, layout and mapping of the region."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import checkfreq as cf
from checkfreq.pipeline.tiers.memory.target import SlotViews
from checkfreq.storage.format import plan_layout
from checkfreq.storage.shm import META_MIN_BYTES, MemoryRegion
from checkfreq.storage.shm_paths import SHM_DIR_ENV, device_and_inode
from helpers import make_model


def _inside(view: torch.Tensor, slot: torch.Tensor) -> bool:
    start = slot.data_ptr()
    return start <= view.data_ptr() < start + slot.numel()


def test_views_are_made_once_per_slot_and_again_once_the_region_is_mapped_anew(tmp_path: Path) -> None:
    layout = plan_layout({"w": (torch.float32, (4, 4)), "b": (torch.int64, (3,))})
    region = MemoryRegion(tmp_path / "region", device_and_inode(tmp_path), slots=3)
    region.reserve(layout.nbytes, 100)
    views = SlotViews()
    first = region.begin()
    made = views.of(region, first, layout)
    assert views.of(region, first, layout) is made  # the same slot, layout and mapping: no view made again
    assert [tuple(v.shape) for v in made] == [tuple(s.shape) for s in layout.slots]
    assert all(_inside(view, first.data) for view in made)
    second = region.begin()
    assert all(_inside(view, second.data) for view in views.of(region, second, layout))

    region.reserve(layout.nbytes, 4 * META_MIN_BYTES)  # the manifest outgrew its room: a new mapping
    third = region.begin()
    remade = views.of(region, third, layout)
    assert remade is not made and all(_inside(view, third.data) for view in remade)
    for view in remade:
        view.fill_(7)
    assert int(third.data[: layout.nbytes].view(torch.uint8).count_nonzero()) > 0  # written into the slot
    region.release(remove=True)


_GROWING_RUN = """
import os, sys, torch
import checkfreq as cf
from checkfreq.storage.shm import META_MIN_BYTES
from helpers import make_model, train_step
model = make_model()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
ckpt = cf.Checkpointer(sys.argv[1], model=model, optimizer=optimizer, policy=cf.Every(10**6), memory=1)
history = []
for step in range(1, 9):
    train_step(model, optimizer)
    history.append("x" * (2 * META_MIN_BYTES))  # past the manifest room's spare at once
    ckpt["history"] = list(history)
    ckpt.step()
ckpt.wait()
torch.save(model.state_dict(), sys.argv[2])
os._exit(0)  # as a kill: the memory snapshots stay, nothing on disk
"""


def test_a_manifest_that_outgrows_its_room_keeps_memory_snapshots_exact(tmp_path: Path) -> None:
    """A value that grows at every step maps the region anew under the same layout: the newest memory
    snapshot still restores bit for bit (no view of an old mapping is written to)."""
    env = {**os.environ, SHM_DIR_ENV: str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}
    run, final = tmp_path / "run", tmp_path / "final.pt"
    subprocess.run([sys.executable, "-c", _GROWING_RUN, str(run), str(final)], env=env, check=True, timeout=300)
    os.environ[SHM_DIR_ENV] = str(tmp_path)
    try:
        model = make_model(seed=1)
        ckpt = cf.Checkpointer(
            run, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), memory=1, values={"history": []}
        )
        assert ckpt.restore() == 8
        assert len(ckpt["history"]) == 8
        expected = torch.load(final)
        for key, value in model.state_dict().items():
            assert torch.equal(value, expected[key]), key
        ckpt.close()
    finally:
        del os.environ[SHM_DIR_ENV]
