"""The order of a GPU snapshot's stream work, on a CPU: sources read before their memory is reused, the
fence's CPU wait, the next forward's waits, a slot never unregistered under a copy, the staging choice.

The device is tests/fake_device.py's: its streams run only when told to (the training stream first,
as a slow side stream lets it), its caching allocator hands a freed block to the next allocation at
once, and it records what ran in which order.
"""

from __future__ import annotations

import gc
import logging
import threading
from pathlib import Path

import pytest
import torch

from checkfreq.errors import PersistTimeoutError
from checkfreq.pipeline.capture.fence import Fence, FenceWait
from checkfreq.pipeline.capture.snapshot import Snapshotter, layout_of
from checkfreq.pipeline.capture.writer import Writer
from checkfreq.pipeline.tiers.memory.tier import MemoryTier
from checkfreq.pipeline.tiers.roles import SnapshotRequest
from checkfreq.policies.memory_cadence import MemoryCadence
from fake_device import FakeDevice


def _values(n: int, seed: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * 0.5 + seed


def _held(pending, name: str) -> torch.Tensor:
    (slot,) = [s for s in pending.layout.slots if s.name == name]
    return pending.buffer[slot.begin : slot.end].view(torch.float32)


@pytest.mark.parametrize("staging", [False, True])
def test_a_temporary_source_freed_after_the_snapshot_is_read_before_its_memory_is_reused(staging: bool) -> None:
    """A DDP share's piece or an optimizer's state_dict() tensor is gone once the snapshot is taken: the
    next forward's allocation must not get its memory before the side stream has copied it."""
    gpu = FakeDevice(auto=False)
    snapshotter = Snapshotter(gpu_staging=staging, ops=gpu)
    expected = _values(4096, 1)
    temporary = gpu.tensor(expected)
    pending = snapshotter.take({"piece": temporary}, deferred={"piece"})
    del temporary
    gc.collect()
    activations = gpu.alloc((4096,))  # the next forward
    gpu.launch(gpu.training, lambda: activations.fill_(-1.0), "forward")
    gpu.run()
    pending.finish_copy()
    assert torch.equal(_held(pending, "piece"), expected)
    assert torch.equal(activations, torch.full((4096,), -1.0))


def test_the_fence_blocks_the_cpu_for_deferred_cpu_tensors_only_never_for_the_device_copy() -> None:
    """Non-fused Adam: the ``step`` counters are CPU tensors deferred beside the device state. The
    next optimizer step waits on the CPU for those, and on the GPU (an event) for the device copy."""
    gpu = FakeDevice(auto=False)  # the device copy runs only when the test says so
    snapshotter = Snapshotter(gpu_staging=False, ops=gpu)
    param, step = gpu.tensor(_values(1024, 2)), torch.tensor(7.0)
    pending = snapshotter.take({"param": param, "step": step}, deferred={"param", "step"}, step=3)
    writer = Writer()
    writer.submit(pending.finish_copy)
    fence, costs = Fence(), []
    fence.arm(pending, writer, 0.0, costs.append)
    try:
        fence.finish(timeout=3.0)  # raised PersistTimeoutError when it waited for the device copy
        assert not [entry for entry in gpu.log if entry[0] == "copy"]  # the GPU has not copied anything yet
        assert _held(pending, "step").tolist() == [7.0]  # the CPU piece is in
        assert len(costs) == 1 and isinstance(costs[0], FenceWait)
        assert len(gpu.waits_on(gpu.training)) == 1  # the next step's kernels wait for the copy's event
    finally:
        gpu.run()
        writer.wait(10)
        writer.close(10)
    assert writer.take_error() is None
    assert torch.equal(_held(pending, "param"), _values(1024, 2))


def test_the_fence_still_times_out_when_the_cpu_copy_never_ends() -> None:
    gpu = FakeDevice(auto=False)
    pending = Snapshotter(ops=gpu).take({"step": torch.tensor(1.0)}, deferred={"step"})
    pending.copy_pieces = lambda: None  # type: ignore[method-assign]  # nobody copies: the writer is stuck
    writer = Writer()
    fence = Fence()
    fence.arm(pending, writer, 0.0, lambda _: None)
    with pytest.raises(PersistTimeoutError):
        fence.finish(timeout=0.6)
    writer.close(10)


def test_the_next_forward_waits_for_the_side_stream_only_after_forward_mutated_tensors_were_copied() -> None:
    gpu = FakeDevice()
    snapshotter = Snapshotter(gpu_staging=True, ops=gpu)
    snapshotter.stepped = True
    state = {"param": gpu.tensor(_values(2048, 0)), "running_mean": gpu.tensor(_values(16, 3))}
    first = snapshotter.take(state, deferred={"param"}, step=1)  # BatchNorm statistics: copied before the forward
    assert len(gpu.waits_on(gpu.training)) == 1
    first.finish_copy()
    only_deferred = snapshotter.take({"param": state["param"]}, deferred={"param"}, step=2)
    # nothing the forward changes: it must not wait for the side stream (in stream order behind the
    # previous snapshot's copy to the host)
    assert len(gpu.waits_on(gpu.training)) == 1
    only_deferred.finish_copy()
    assert torch.equal(_held(only_deferred, "param"), _values(2048, 0))


def test_the_staging_choice_waits_for_a_whole_step_counts_the_peak_and_is_made_again_when_the_state_grows(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="checkfreq.snapshot")
    gpu = FakeDevice()
    snapshotter = Snapshotter(ops=gpu)
    small = {"p": gpu.tensor(_values(1024, 0))}  # 4 KiB
    snapshotter.take(small, deferred={"p"}).finish_copy()
    assert snapshotter._staging == {}  # before a whole step: no choice made, straight to the host
    snapshotter.stepped = True
    # 1 GB free + 1 GB held by the allocator, but a step peaked at 1.99 GB: the reserved blocks are
    # the next forward's, 10 MB are left, and 4 KiB fit in half of them
    gpu.memory_figures = (10**9, 10**9, 199 * 10**7)
    snapshotter.take(small, deferred={"p"}).finish_copy()
    assert snapshotter.staging_bytes(gpu.device) >= 4096
    grown = {"p": small["p"], "q": gpu.tensor(_values(4 << 20, 1))}  # 16 MiB more: no longer fit in 5 MB
    pending = snapshotter.take(grown, deferred={"p", "q"})
    pending.finish_copy()
    assert snapshotter._staging[gpu.device] is None
    assert torch.equal(_held(pending, "q"), _values(4 << 20, 1))
    reasons = [r.getMessage() for r in caplog.records if "snapshots of" in r.getMessage()]
    assert len(reasons) == 2 and "GPU staging buffer" in reasons[0] and "direct copy" in reasons[1]


def test_a_staging_buffer_that_cannot_be_allocated_falls_back_to_the_direct_copy(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gpu = FakeDevice()
    gpu.refuse_empty = True
    snapshotter = Snapshotter(gpu_staging=True, ops=gpu)
    state = {"p": gpu.tensor(_values(1024, 5))}
    pending = snapshotter.take(state, deferred={"p"})
    pending.finish_copy()
    assert torch.equal(_held(pending, "p"), _values(1024, 5))
    assert "no device memory left for the staging buffer" in caplog.text
    gpu.refuse_empty = False
    snapshotter.take(state, deferred={"p"}).finish_copy()  # the fallback stays: no retry at every snapshot
    assert snapshotter._staging[gpu.device] is None


def test_close_gives_the_host_buffer_and_the_staging_buffer_back() -> None:
    gpu = FakeDevice()
    snapshotter = Snapshotter(gpu_staging=True, ops=gpu)
    snapshotter.take({"p": gpu.tensor(_values(1024, 0)), "c": torch.zeros(3)}, deferred={"p"}).finish_copy()
    assert snapshotter.nbytes > 0 and snapshotter.staging_bytes(gpu.device) > 0
    snapshotter.close()
    assert snapshotter.nbytes == 0 and snapshotter.staging_bytes(gpu.device) == 0


def _request(layout, step: int) -> SnapshotRequest:
    return SnapshotRequest(layout, {}, step, None, {}, 0.0, device_copies=True, sharded=False)


def test_a_growing_memory_region_waits_for_the_persist_still_copying_into_its_registered_slot(
    shm_dir: Path, tmp_path: Path
) -> None:
    gpu = FakeDevice(auto=False)
    tier = MemoryTier(tmp_path, MemoryCadence(every=1), data_file="data.safetensors")
    tier.pinning.registry = gpu.registry
    snapshotter = Snapshotter(gpu_staging=False, ops=gpu)
    state = {"param": gpu.tensor(_values(1024, 0))}
    layout = layout_of(state)
    target = tier.target(_request(layout, 1))
    assert target is not None and gpu.registry.registered()
    pending = snapshotter.take(state, deferred={"param"}, layout=layout, buffer=target.buffer, step=1)
    persist_writer = Writer()
    persist_writer.submit(tier.around_persist(target, pending, lambda: None))  # the persist's copy is queued
    grown = {**state, "more": gpu.tensor(_values(1 << 20, 1))}  # the state grew: the region is made again
    timer = threading.Timer(0.5, gpu.run)  # the GPU gets to the persist's copy a little later
    timer.start()
    try:
        assert tier.target(_request(layout_of(grown), 2)) is not None
    finally:
        timer.join()
        gpu.run()
        persist_writer.wait(10)
        persist_writer.close(10)
        tier.close(remove=True)
    assert gpu.violations == []
    kinds = [entry[0] for entry in gpu.log if entry[0] in ("copy", "synchronized")]
    assert kinds[:2] == ["copy", "synchronized"]
    assert [kind for kind, *_ in gpu.registry.calls][:2] == ["register", "unregister"]


@pytest.mark.parametrize("seen", [False, True])
def test_a_slot_the_device_does_not_see_pinned_is_reported_once_with_its_copy_bandwidth(
    shm_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, seen: bool
) -> None:
    """A slot registered without the device seeing it pinned copies at the pageable bandwidth: the first
    snapshot copied into one says so, with the bandwidth its timed device-to-host copy reached."""
    gpu = FakeDevice()
    gpu.registry.pinned_seen = seen
    tier = MemoryTier(tmp_path, MemoryCadence(every=1), data_file="data.safetensors")
    tier.pinning.registry = gpu.registry
    snapshotter = Snapshotter(gpu_staging=False, ops=gpu)
    state = {"param": gpu.tensor(_values(1 << 16, 0)), "buffer": gpu.tensor(_values(256, 1))}
    layout = layout_of(state)
    timed = []
    try:
        with caplog.at_level(logging.WARNING, logger="checkfreq.memory"):
            for step in (1, 2, 3):
                target = tier.target(_request(layout, step))
                assert target is not None
                pending = snapshotter.take(
                    state, deferred={"param"}, layout=layout, buffer=target.buffer, step=step, memory=True
                )
                tier.submit(target, pending, {}, None).wait(10)
                timed.append(pending.host_copy())
    finally:
        tier.close(remove=True)
    warnings = [r.getMessage() for r in caplog.records if "does not see it pinned" in r.getMessage()]
    if seen:
        assert warnings == []
        return
    nbytes, seconds = timed[0]
    assert nbytes == (1 << 16) * 4 + 256 * 4 and seconds > 0
    assert len(warnings) == 1  # once, not at every snapshot
    assert f"ran at {nbytes / seconds / 1e9:.2f} GB/s" in warnings[0] and "pageable" in warnings[0]


def test_closing_a_checkpointer_gives_its_snapshot_buffer_back(tmp_path: Path) -> None:
    import checkfreq as cf
    from helpers import make_model, train_step

    model = make_model(width=256)
    opt = torch.optim.Adam(model.parameters())
    ckpt = cf.Checkpointer(tmp_path, policy=1000, model=model, optimizer=opt)
    train_step(model, opt)
    ckpt.step()
    ckpt.save(blocking=True)
    assert ckpt._saver.snapshotter.nbytes > 0
    ckpt.close()
    assert ckpt._saver.snapshotter.nbytes == 0  # on a GPU: the pinned buffer (16 GiB for 12.5 GB of state)


def test_a_growing_memory_region_waits_for_the_persist_writing_to_disk_from_its_slot(
    shm_dir: Path, tmp_path: Path
) -> None:
    """The persist writes to disk from a view of the slot: the region it maps must outlive the write."""
    tier = MemoryTier(tmp_path, MemoryCadence(every=1), data_file="data.safetensors")
    state = {"w": _values(1024, 0)}
    layout = layout_of(state)
    target = tier.target(SnapshotRequest(layout, {}, 1, None, {}, 0.0, device_copies=False, sharded=False))
    assert target is not None
    pending = Snapshotter().take(state, deferred=set(), layout=layout, buffer=target.buffer, step=1)
    gate, seen = threading.Event(), []

    def persist() -> None:
        gate.wait(10)
        seen.append((tier.region.nbytes, torch.equal(target.buffer[: layout.nbytes].view(torch.float32), state["w"])))

    writer = Writer()
    writer.submit(tier.around_persist(target, pending, persist))
    size = tier.region.nbytes
    timer = threading.Timer(0.5, gate.set)
    timer.start()
    grown = {**state, "more": _values(1 << 20, 1)}
    try:
        assert (
            tier.target(SnapshotRequest(layout_of(grown), {}, 2, None, {}, 0.0, device_copies=False, sharded=False))
            is not None
        )
    finally:
        timer.join()
        writer.wait(10)
        writer.close(10)
    assert seen == [(size, True)]  # the write read the slot it was given, in the mapping it was given
    assert tier.region.nbytes > size
    tier.close(remove=True)
