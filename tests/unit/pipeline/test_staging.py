"""The GPU paths of a snapshot: the staging choice and buffer (on the CPU), and on CUDA the staged
snapshot, the memory tier's pinned slots, the GPU-side waits and the restore onto the device."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import checkfreq as cf
from checkfreq.pipeline.capture.staging import ALIGN, StagingBuffer, choose_staging, staging_offsets
from checkfreq.run.events import read_events
from fake_device import FakeDevice
from helpers import make_model, memory_tier

GB = 10**9
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_staging_is_chosen_when_the_state_fits_in_half_the_free_memory_or_when_forced() -> None:
    assert choose_staging(12 * GB, 24 * GB, None).use  # exactly half
    no = choose_staging(12 * GB, 24 * GB - 1, None)
    assert not no.use and "do not fit in half of the 24.00 GB a training step leaves free" in no.reason
    assert "gpu_staging=True" in no.reason
    yes = choose_staging(int(12.47 * GB), 60 * GB, None)
    assert yes.use and "12.47 GB fit in half of the 60.00 GB a training step leaves" in yes.reason
    assert choose_staging(100 * GB, 1, True) == choose_staging(100 * GB, 1, True)
    assert choose_staging(100 * GB, 1, True).use and "forced" in choose_staging(100 * GB, 1, True).reason
    assert not choose_staging(1, 100 * GB, False).use


def test_staging_offsets_are_aligned_and_do_not_overlap() -> None:
    sizes = [1, ALIGN, 3 * ALIGN + 5, 0, 7]
    offsets, total = staging_offsets(sizes)
    assert all(at % ALIGN == 0 for at in offsets)
    assert all(a + n <= b for a, n, b in zip(offsets, sizes, offsets[1:], strict=False))
    assert total >= offsets[-1] + sizes[-1] and total % ALIGN == 0


def test_the_staging_buffer_holds_each_tensor_exactly_and_is_reused() -> None:
    tensors = [
        torch.randn(3, 5, dtype=torch.bfloat16),
        torch.arange(7, dtype=torch.int64),
        torch.rand(4, 4).t(),
        torch.tensor([True, False, True]),
    ]  # a strided one among them
    staging = StagingBuffer(torch.device("cpu"), FakeDevice())
    views = staging.views_for(tensors)
    for view, src in zip(views, tensors, strict=True):
        assert view.dtype == src.dtype and view.shape == src.shape and view.is_contiguous()
        view.copy_(src)
    for view, src in zip(views, tensors, strict=True):  # no view overwrote another
        assert torch.equal(view, src)
    first = views[0].data_ptr()
    assert staging.views_for(tensors)[0].data_ptr() == first  # same shapes: the same buffer
    grown = [torch.zeros(1000), *tensors]
    assert staging.views_for(grown)[0].numel() == 1000 and staging.nbytes >= 4000


def test_the_gpu_staging_option_is_checked(tmp_path: Path) -> None:
    model = make_model()
    with pytest.raises(cf.InvalidArgumentError, match="gpu_staging"):
        cf.Checkpointer(tmp_path, gpu_staging="yes", model=model)  # type: ignore[arg-type]


def _train(
    model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, ckpt: cf.Checkpointer | None, device: str = "cuda"
) -> None:
    x = torch.randn(64, 8, device=device)
    for _ in range(steps):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        if ckpt is not None:
            ckpt.step()


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("staging", [True, False])
def test_a_cuda_snapshot_is_consistent_with_and_without_staging(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, staging: bool
) -> None:
    caplog.set_level(logging.INFO, logger="checkfreq.snapshot")
    model = make_model(width=1024).cuda()
    opt = torch.optim.Adam(model.parameters())
    with cf.Checkpointer(tmp_path, policy=1000, gpu_staging=staging, model=model, optimizer=opt) as ckpt:
        _train(model, opt, 3, ckpt)
        ckpt.save()
        at_k = {k: v.cpu() for k, v in model.state_dict().items()}
        _train(model, opt, 3, ckpt)  # the next optimizer steps run while the copy to the host goes on
        ckpt.wait()
        torch.cuda.synchronize()
        _train(model, opt, 1, ckpt)  # this step() finds every timed wait passed by the GPU
        assert (ckpt._saver.snapshotter._staging[torch.device("cuda", 0)] is not None) == staging
    _, tensors = cf.read_checkpoint(tmp_path / "step_000000003")
    for key, value in at_k.items():
        assert torch.equal(tensors[f"model/{key}"], value), key
    assert any(
        ("GPU staging buffer" if staging else "direct copy to the host") in r.getMessage() for r in caplog.records
    )
    waits = [e for e in read_events(tmp_path) if e["event"] == "gpu_wait"]
    assert waits and all(e["step"] == 3 and e["wait_s"] >= 0 for e in waits)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, cuda])])
def test_the_memory_tier_pins_its_slots_for_cuda_and_restores_onto_the_device(
    shm_dir: Path, tmp_path: Path, device: str
) -> None:
    model = make_model(width=1024).to(device)
    opt = torch.optim.Adam(model.parameters())
    ckpt = cf.Checkpointer(tmp_path, policy=1000, memory=1, model=model, optimizer=opt)
    _train(model, opt, 4, ckpt, device)
    ckpt.wait()
    region = memory_tier(ckpt).region
    assert region.pinned_slots == ({0, 1} if device == "cuda" else set())  # CPU state: no device copies
    if device == "cuda":
        assert all(region.slot_data(s).is_pinned() for s in (0, 1))  # each slot its own storage
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    memory_tier(ckpt).close(remove=False)  # as if killed: the region stays, nothing reaches disk
    ckpt._finalizer()

    model2 = make_model(seed=1, width=1024).to(device)
    opt2 = torch.optim.Adam(model2.parameters())
    with cf.Checkpointer(tmp_path, policy=1000, memory=1, model=model2, optimizer=opt2) as again:
        assert again.restore() == 4
        if device == "cuda":
            assert memory_tier(again).region.pinned_slots  # the slot read for the GPU was pinned first
    assert all(v.device.type == device for v in model2.state_dict().values())
    assert all(torch.equal(v.cpu(), expected[k]) for k, v in model2.state_dict().items())
    restore = [e for e in read_events(tmp_path) if e["event"] == "restore"][-1]
    assert restore["tier"] == "memory" and restore["restore_s"] > 0


def test_gpu_side_waits_raise_the_costs_the_policy_and_the_cadence_see() -> None:
    from checkfreq.pipeline.capture.gpu_waits import GpuWaits
    from checkfreq.policies.memory_cadence import MemoryCadence
    from checkfreq.policies.profiler import Profiler

    assert GpuWaits().collect() == []  # nothing is ever recorded without CUDA: the CPU's stall stands
    profiler = Profiler()
    profiler.record_stall(0.011)
    profiler.record_device_wait(0.28)  # the H100's step that was 0.28 s longer than the CPU saw
    assert profiler.stall.value == pytest.approx(0.291)
    cadence = MemoryCadence()
    cadence.record_device_wait(0.5)  # before any cost is measured: nothing to raise
    assert cadence.cost.count == 0
    cadence.record(0.01)  # the first one is left out (one-time costs)
    cadence.record(0.01)
    cadence.record_device_wait(0.2)
    assert cadence.cost.value == pytest.approx(0.21)
    assert cadence.interval(0.22) > cadence.interval(0.22 * 100)


@pytest.mark.cuda
@cuda
def test_a_fresh_optimizer_is_restored_straight_onto_the_device(shm_dir: Path, tmp_path: Path) -> None:
    """Its state goes from the pinned memory slot to the device, not through a pageable clone; non-fused
    Adam's ``step`` counters stay on the CPU, where that optimizer keeps them."""
    model = make_model(width=256).cuda()
    opt = torch.optim.Adam(model.parameters())
    with cf.Checkpointer(tmp_path, policy=1000, memory=1, model=model, optimizer=opt) as ckpt:
        _train(model, opt, 3, ckpt)
        ckpt.wait()
        expected = {k: {n: v.cpu() for n, v in s.items()} for k, s in opt.state_dict()["state"].items()}
        memory_tier(ckpt).close(remove=False)
        ckpt._finalizer()
    model2 = make_model(seed=1, width=256).cuda()
    opt2 = torch.optim.Adam(model2.parameters())
    with cf.Checkpointer(tmp_path, policy=1000, memory=1, model=model2, optimizer=opt2) as again:
        assert again.restore() == 3
        for pid, entry in opt2.state_dict()["state"].items():
            assert entry["exp_avg"].is_cuda and entry["exp_avg_sq"].is_cuda and not entry["step"].is_cuda
            assert all(torch.equal(v.cpu(), expected[pid][n]) for n, v in entry.items())
        _train(model2, opt2, 1, again)  # the restored optimizer steps


def _busy_side_stream(snapshotter, device: torch.device) -> None:  # type: ignore[no-untyped-def]
    """Keep the snapshotter's side stream busy for about a second, so its copies start late."""
    stream = snapshotter._streams.setdefault(device, torch.cuda.Stream(device))
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000_000)


@pytest.mark.cuda
@cuda
def test_a_freed_cuda_temporary_is_copied_before_the_next_forward_reuses_its_memory() -> None:
    from checkfreq.pipeline.capture.snapshot import Snapshotter

    device = torch.device("cuda", torch.cuda.current_device())
    snapshotter = Snapshotter(gpu_staging=False)
    param = torch.arange(1 << 20, dtype=torch.float32, device=device)
    _busy_side_stream(snapshotter, device)
    temporary = param * 1  # as a DDP share's piece of a channels_last tensor is
    pending = snapshotter.take({"piece": temporary}, deferred={"piece"})
    del temporary
    activations = torch.empty_like(param).fill_(-1.0)  # the caching allocator's freed block, if nothing held it
    pending.finish_copy()
    held = pending.buffer[: param.numel() * 4].view(torch.float32)
    assert torch.equal(held, param.cpu())
    assert bool((activations == -1.0).all())


@pytest.mark.cuda
@cuda
def test_the_fence_of_a_non_fused_adam_does_not_wait_on_the_cpu_for_the_device_copy(tmp_path: Path) -> None:
    model = make_model(width=1024).cuda()
    opt = torch.optim.Adam(model.parameters())  # non-fused: its step counters are CPU tensors
    with cf.Checkpointer(tmp_path, policy=1000, gpu_staging=False, model=model, optimizer=opt) as ckpt:
        _train(model, opt, 2, ckpt)
        ckpt.save()
        ckpt.wait()
        device = torch.device("cuda", torch.cuda.current_device())
        _busy_side_stream(ckpt._saver.snapshotter, device)
        _train(model, opt, 1, ckpt)
        ckpt.save()
        pending = ckpt._saver.fence._pending
        assert pending is not None and pending.cpu_fence and pending.cuda_done
        _train(model, opt, 1, None)  # optimizer.step(): the fence
        assert not pending.cuda_done[0].query()  # it returned while the side stream still sleeps
        ckpt.wait()
