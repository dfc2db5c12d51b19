"""The host buffer of device copies: registered exactly as large as asked (not rounded up to a power
of two by torch's pinned allocator), aligned for direct I/O, and given back at the snapshotter's
close (the books on the CPU, the registration on CUDA)."""

from __future__ import annotations

import mmap

import pytest
import torch

from checkfreq.pipeline.capture.snapshot import Snapshotter
from checkfreq.storage.format import BLOCK_BYTES, plan_layout
from checkfreq.storage.host_buffer import RegisteredBuffer
from checkfreq.storage.host_pinning import CudaHostRegistry, RecordingRegistry


class RefusingRegistry(RecordingRegistry):
    def _pin(self, address: int, nbytes: int) -> bool:
        self._ranges.pop(address)
        return False


def test_a_registered_buffer_is_registered_once_at_its_size_and_unregistered_at_release() -> None:
    registry = RecordingRegistry()
    nbytes = 3 * mmap.PAGESIZE + 17
    buffer = RegisteredBuffer(nbytes, registry)
    assert buffer.pinned and buffer.tensor.numel() == nbytes and buffer.tensor.data_ptr() % BLOCK_BYTES == 0
    assert registry.registered() == {buffer.tensor.data_ptr(): nbytes}
    view = buffer.tensor[10:20]
    buffer.release()
    buffer.release()  # once only
    assert not buffer.pinned and registry.registered() == {}
    assert [call[0] for call in registry.calls] == ["register", "unregister"]
    view.fill_(7)  # the memory lives as long as a view of it
    assert bool((view == 7).all())


def test_the_snapshotter_registers_its_device_copy_buffer_and_gives_it_back_at_close() -> None:
    registry = RecordingRegistry()
    snapshotter = Snapshotter(registry=registry)
    small = plan_layout({"w": (torch.float32, (1000,))})
    large = plan_layout({"w": (torch.float32, (5000,))})
    buffer, _ = snapshotter._views_for(small, pin=True)
    assert registry.registered() == {buffer.data_ptr(): small.nbytes}
    assert snapshotter._views_for(small, pin=True)[0] is buffer  # reused while the layout holds
    buffer, _ = snapshotter._views_for(large, pin=True)  # the layout changed: the old one given back first
    assert registry.registered() == {buffer.data_ptr(): large.nbytes}
    assert [call[0] for call in registry.calls] == ["register", "unregister", "register"]
    snapshotter.close()
    assert registry.registered() == {}


def test_a_refused_registration_falls_back_to_pinned_memory_from_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[bool] = []
    real = torch.empty

    def empty(*args, pin_memory: bool = False, **kwargs):  # type: ignore[no-untyped-def]
        asked.append(pin_memory)
        return real(*args, **kwargs)  # no CUDA here: what was asked for is the point

    monkeypatch.setattr(torch, "empty", empty)
    snapshotter = Snapshotter(registry=RefusingRegistry())
    buffer, _ = snapshotter._views_for(plan_layout({"w": (torch.float32, (1000,))}), pin=True)
    assert asked == [True] and buffer.data_ptr() % BLOCK_BYTES == 0
    snapshotter.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_snapshot_buffer_is_pinned_exactly_and_unregistered_at_close() -> None:
    registry = CudaHostRegistry()
    snapshotter = Snapshotter(gpu_staging=False, registry=registry)
    weights = torch.randn(3_000_000, device="cuda")
    pending = snapshotter.take({"w": weights}, deferred={"w"})
    pending.finish_copy()
    ((address, nbytes),) = registry.registered().items()
    assert address == pending.buffer.data_ptr() and nbytes == pending.layout.nbytes  # not a power of two
    assert pending.buffer.is_pinned()
    assert torch.equal(pending.buffer[: weights.numel() * 4].view(torch.float32), weights.cpu())
    snapshotter.close()
    assert registry.registered() == {}
