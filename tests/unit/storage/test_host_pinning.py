"""The memory tier on a GPU: slots pinned for device copies (the books on the CPU, the registration on
CUDA), chunked checksums, and large snapshots committed before their checksum, sealed afterwards."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from checkfreq.storage.host_pinning import CudaHostRegistry, PinningError, RecordingRegistry
from checkfreq.storage.parallel_hash import CHUNK_BYTES, chunked_xxh3
from checkfreq.storage.shm import PENDING, MemoryRegion, ShmSnapshotError, layout_signature

SIG = layout_signature(("x",))


def test_a_slot_is_registered_once_and_unregistered_before_the_region_is_unmapped(
    shm_dir: Path, tmp_path: Path
) -> None:
    registry = RecordingRegistry()
    region = MemoryRegion.for_directory(tmp_path)
    region.reserve(8192, 100)
    first = region.begin()
    assert region.pin_slot(first.slot, registry) and region.pin_slot(first.slot, registry)  # idempotent
    assert len(registry.registered()) == 1
    ((address, nbytes),) = registry.registered().items()
    assert address == first.data.data_ptr() and nbytes == first.data.numel()  # exactly the slot's data area
    region.pin_slot(1 - first.slot, registry)
    assert region.pinned_slots == {0, 1} and len(registry.registered()) == 2

    region.reserve(4 << 20, 100)  # the state grew: a new mapping, the old one's ranges unregistered first
    assert registry.registered() == {} and region.pinned_slots == frozenset()
    grown = region.begin()
    region.pin_slot(grown.slot, registry)
    assert registry.registered() == {grown.data.data_ptr(): grown.data.numel()} and grown.data.numel() >= 4 << 20
    region.release(remove=True)
    assert registry.registered() == {}
    kinds = [kind for kind, *_ in registry.calls]
    assert kinds == ["register", "register", "unregister", "unregister", "register", "unregister"]


def test_the_books_refuse_a_double_registration_and_a_stray_unregistration() -> None:
    registry = RecordingRegistry()
    registry.register(4096, 10)
    with pytest.raises(PinningError, match="registered already"):
        registry.register(4096, 10)
    registry.unregister(4096)
    with pytest.raises(PinningError, match="not registered"):
        registry.unregister(4096)


def test_the_chunked_checksum_covers_every_chunk_and_the_metadata() -> None:
    data = bytearray(os.urandom(1024)) * (2 * CHUNK_BYTES // 1024 + 3)  # three chunks, the last one short
    digest = chunked_xxh3(memoryview(data), b"meta")
    assert chunked_xxh3(memoryview(data), b"meta") == digest  # the thread pool does not change it
    assert chunked_xxh3(memoryview(data), b"metb") != digest
    for at in (0, CHUNK_BYTES + 7, len(data) - 1):
        data[at] ^= 1
        assert chunked_xxh3(memoryview(data), b"meta") != digest, at
        data[at] ^= 1


def test_a_pinned_slot_commits_and_reads_back(shm_dir: Path, tmp_path: Path) -> None:
    region = MemoryRegion.for_directory(tmp_path)
    region.reserve(8192, 100)
    registry = RecordingRegistry()
    target = region.begin()
    region.pin_slot(target.slot, registry)
    target.data[:8192].fill_(7)
    info = region.commit(target, 5, 8192, json.dumps({"step": 5}).encode(), SIG)
    meta, data = region.read(info)
    assert json.loads(meta) == {"step": 5} and bool((data == 7).all())
    target.data[100] = 8
    with pytest.raises(ShmSnapshotError):
        region.read(info)
    region.release(remove=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_registered_slot_is_pinned_for_cuda_copies(shm_dir: Path, tmp_path: Path) -> None:
    registry = CudaHostRegistry()
    region = MemoryRegion.for_directory(tmp_path)
    region.reserve(64 << 20, 100)
    target = region.begin()
    assert not target.data.is_pinned()
    assert region.pin_slot(target.slot, registry)
    assert target.data.is_pinned()  # CUDA sees the registered mapping as page-locked
    src = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        target.data[: src.numel()].copy_(src, non_blocking=True)
    stream.synchronize()
    assert torch.equal(target.data[: src.numel()], src.cpu())
    region.release(remove=True)
    assert registry.registered() == {}


def test_a_snapshot_committed_before_its_checksum_is_sealed_afterwards(shm_dir: Path, tmp_path: Path) -> None:
    region = MemoryRegion.for_directory(tmp_path)
    region.reserve(8192, 100)
    target = region.begin()
    target.data[:8192].fill_(3)
    info = region.commit(target, 1, 8192, b"{}", SIG, checksum=False)
    assert info.checksum == PENDING and region.snapshots() == [info]
    assert bool((region.read(info)[1] == 3).all())  # complete: the header came after the copy
    sealed = region.seal(info)
    assert sealed is not None and sealed.checksum != PENDING and region.snapshots() == [sealed]
    target.data[5] = 4
    with pytest.raises(ShmSnapshotError):  # sealed: a flipped byte is caught again
        region.read(sealed)
    target.data[5] = 3

    second = region.begin()
    info2 = region.commit(second, 2, 8192, b"{}", SIG, checksum=False)
    reopened = region.begin()  # the slot of step 1 is reused before step 2's seal ran...
    assert reopened.slot == sealed.slot
    assert region.seal(info2) is not None and region.seal(sealed) is None  # ...so step 1's is given up
    region.release(remove=True)


def test_large_memory_snapshots_are_sealed_off_the_training_thread(
    shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import checkfreq as cf
    import helpers
    from checkfreq.pipeline.tiers.memory import tier as memory_tier
    from helpers import make_model, train_step

    assert not memory_tier.seal_later(False, 100 << 30) and memory_tier.seal_later(True, 256 << 20)
    assert not memory_tier.seal_later(True, (256 << 20) - 1)
    monkeypatch.setattr(memory_tier, "seal_later", lambda *_: True)  # every snapshot counts as a large GPU one
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with cf.Checkpointer(tmp_path, policy=1000, memory=1, model=model, optimizer=opt) as ckpt:
        for _ in range(3):
            train_step(model, opt)
            ckpt.step()
        ckpt.wait()
        tier = helpers.memory_tier(ckpt)
        tier.wait_sealed()
        infos = tier.region.snapshots()
        assert [i.step for i in infos] == [3, 2] and all(i.checksum != PENDING for i in infos)
        states, skipped = tier.snapshots()
        assert [s.manifest.step for s in states] == [3, 2] and not skipped


def test_each_slot_is_a_storage_of_its_own_starting_at_the_slot(shm_dir: Path, tmp_path: Path) -> None:
    """CUDA's is_pinned() asks about a tensor's storage start: a view of the whole region's storage
    starts at the unregistered header page and would never look pinned."""
    region = MemoryRegion.for_directory(tmp_path)
    region.reserve(8192, 100)
    for _ in range(2):
        data = region.begin().data
        assert data.untyped_storage().data_ptr() == data.data_ptr()
        assert data.untyped_storage().nbytes() == data.numel()
    region.release(remove=True)


class RefusingRegistry(RecordingRegistry):
    def _pin(self, address: int, nbytes: int) -> bool:
        self._ranges.pop(address)
        return False


def test_a_refused_registration_is_asked_once_per_mapping(shm_dir: Path, tmp_path: Path) -> None:
    region = MemoryRegion.for_directory(tmp_path)
    region.reserve(8192, 100)
    registry = RefusingRegistry()
    slot = region.begin().slot
    assert not region.pin_slot(slot, registry) and not region.pin_slot(slot, registry)
    assert len(registry.calls) == 1 and region.pinned_slots == frozenset()
    region.reserve(4 << 20, 100)  # a new mapping: asked again, once
    assert not region.pin_slot(slot, registry) and not region.pin_slot(slot, registry)
    assert len(registry.calls) == 2
    region.release(remove=True)


class SealRacingClear(MemoryRegion):
    """A region whose seal, once past its last check, lets a clear() from another thread run first."""

    def _write_header(self, info) -> None:  # type: ignore[no-untyped-def]
        if info.checksum != PENDING and not getattr(self, "raced", False):
            self.raced = True
            cleared = threading.Event()
            threading.Thread(target=lambda: (self.clear(), cleared.set()), daemon=True).start()
            cleared.wait(1.0)  # under the region's lock the clear waits for the seal instead
        super()._write_header(info)


def test_a_seal_racing_a_clear_never_brings_the_snapshot_back(shm_dir: Path, tmp_path: Path) -> None:
    region = SealRacingClear(MemoryRegion.for_directory(tmp_path).path, (0, 0))
    region.reserve(8192, 100)
    target = region.begin()
    info = region.commit(target, 7, 8192, b"{}", SIG, checksum=False)
    region.seal(info)
    deadline = time.monotonic() + 10
    while region.snapshots() and time.monotonic() < deadline:
        time.sleep(0.01)  # the clear runs once the seal let go of the lock
    assert region.snapshots() == []  # the restore went back before step 7: step 7 stays invalid
    region.release(remove=True)


def test_a_memory_restore_waits_for_the_checksum_in_flight(shm_dir: Path, tmp_path: Path) -> None:
    from checkfreq.pipeline.capture.snapshot import Snapshotter, layout_of
    from checkfreq.pipeline.tiers.memory.target import MemoryTarget
    from checkfreq.pipeline.tiers.memory.tier import MemoryTier
    from checkfreq.policies.memory_cadence import MemoryCadence
    from checkfreq.storage.format import Manifest, tensor_entries

    tier = MemoryTier(tmp_path, MemoryCadence(every=1), data_file="data.safetensors")
    tensors = {"w": torch.arange(4096, dtype=torch.float32)}
    layout = layout_of(tensors)
    meta = Manifest(
        step=3,
        epoch=None,
        world_size=1,
        files={"data.safetensors": {"size": layout.nbytes, "xxh3_64": ""}},
        tensors=tensor_entries(layout, "data.safetensors"),
        state={},
        versions={},
        created=0.0,
    ).to_json()
    tier.region.reserve(layout.nbytes, len(meta))
    target = MemoryTarget(tier.region.begin(), 3, layout, meta, 0.0, seal_later=True)
    gate = threading.Event()
    tier._sealer = ThreadPoolExecutor(1)
    tier._sealer.submit(gate.wait, 10)  # the sealer is busy: the seal of step 3 queues behind
    tier.commit(target, Snapshotter().take(tensors, set(), layout=layout, buffer=target.buffer))
    threading.Timer(0.3, gate.set).start()
    states, skipped = tier.snapshots()
    assert [s.manifest.step for s in states] == [3] and skipped == []
    assert tier.region.snapshots()[0].checksum != PENDING  # restored only once verifiable
    tier.close(remove=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_refused_registration_leaves_no_cuda_error_for_the_next_kernel() -> None:
    pinned = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)  # registered already: CUDA refuses
    registry = CudaHostRegistry()
    assert not registry.register(pinned.data_ptr(), pinned.numel())
    x = torch.ones(1024, device="cuda")
    assert float((x * 2).sum()) == 2048.0  # the launch check finds no error left by the refusal
    torch.cuda.synchronize()
