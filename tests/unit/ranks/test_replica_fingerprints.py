"""Where the replica claim's fingerprints are taken (checkfreq.ranks.replicas): host tensors at the
snapshot, device tensors from copies the snapshot's side stream makes, hashed off the training thread;
and how much of a device's replicated state the first check of a layout copies to the host."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import xxhash

from checkfreq.pipeline.capture.snapshot import Snapshotter
from checkfreq.ranks import replicas
from checkfreq.ranks.group_cluster import SharePlan
from fake_device import FakeDevice


def _bytes_hash(tensor: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(tensor.contiguous().view(torch.uint8).numpy().tobytes())


def test_a_device_piece_is_hashed_from_its_stream_ordered_copy_by_the_writer_never_on_the_training_thread() -> None:
    gpu = FakeDevice(auto=False)  # nothing runs on the "GPU" until the test says so
    weight, counter = gpu.tensor(torch.arange(4096, dtype=torch.float32)), torch.tensor([3.0])
    gpu.launch(gpu.training, lambda: weight.add_(1.0), "optimizer step")  # queued before the snapshot, not run
    layout = (("counter", "torch.float32", (1,)), ("weight", "torch.float32", (4096,)))
    claim, later = replicas.claim(layout, {"weight": weight, "counter": counter}, gpu.is_device)
    assert claim["fingerprints"] == {"counter": _bytes_hash(counter)}  # a host tensor: hashed at once
    assert list(later) == ["weight"]
    pending = Snapshotter(ops=gpu).take({"weight": weight}, deferred={"weight"}, aside=later)
    assert not [entry for entry in gpu.log if entry[0] == "copy"]  # the training thread read nothing of the device
    hashed_on = []

    def writer() -> None:  # what the commit does on the writer thread
        pending.finish_copy()
        replicas.resolve(claim, pending.aside)
        hashed_on.append(threading.current_thread())

    thread = threading.Thread(target=writer)
    thread.start()
    gpu.run()  # the GPU gets there: the optimizer step's kernel first, then the side stream's copies
    thread.join(10)
    assert hashed_on == [thread]
    assert claim["fingerprints"] == {
        "counter": _bytes_hash(counter),
        "weight": _bytes_hash(torch.arange(4096, dtype=torch.float32) + 1.0),
    }
    assert [e[1] for e in gpu.log if e[0] == "copy"] == ["side1", "side1"]  # the state's copy and the claim's


def test_a_fingerprint_is_never_taken_of_device_memory_directly() -> None:
    with pytest.raises(ValueError, match="host memory"):
        replicas.fingerprint(torch.empty(3, device="meta"))


def _plan(sizes: dict[str, int]) -> SharePlan:
    tensors = {name: torch.empty(numel, device="meta") for name, numel in sorted(sizes.items())}
    layout = tuple((n, str(t.dtype), tuple(t.shape)) for n, t in tensors.items())
    return SharePlan.of(layout, tensors, world_size=4, rank=1)


def test_the_first_check_on_a_device_copies_a_bounded_head_of_every_tensor() -> None:
    sizes = {f"model/layer{i}.weight": 1 << 28 for i in range(40)} | {"model/bias": 7, "model/empty": 0}
    plan = _plan(sizes)  # 40 GiB of float32 state
    first = plan.verify_first(device=True)
    assert [p.name for p in first] == sorted(sizes)  # every tensor is checked at once
    assert all(p.begin == 0 for p in first)
    assert sum((p.end - p.begin) * 4 for p in first) <= replicas.FIRST_DEVICE_BYTES
    assert {p.name: p.whole for p in first if p.end - p.begin == sizes[p.name]} == {
        "model/bias": True,
        "model/empty": True,
    }
    on_host = plan.verify_first(device=False)
    assert [(p.name, p.begin, p.end, p.whole) for p in on_host] == [(n, 0, sizes[n], True) for n in sorted(sizes)]
    window = plan.verify_next()  # later checks: a window of the stream, as on the host
    assert sum((p.end - p.begin) * 4 for p in window) <= replicas.VERIFY_BYTES


def test_the_claims_pieces_go_straight_to_the_host_and_never_reshape_the_staging_buffer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The window verified changes at every checkpoint; the staging buffer is laid out for the state
    and must stay as it is (made again, it would cost a device allocation of the state's size)."""
    gpu = FakeDevice()
    snapshotter = Snapshotter(gpu_staging=True, ops=gpu)
    weight = gpu.tensor(torch.arange(8192, dtype=torch.float32))
    windows = [(0, 100), (100, 3000), (3000, 8192)]
    with caplog.at_level(logging.INFO, logger="checkfreq.snapshot"):
        for begin, end in windows:
            piece = weight[begin:end]
            pending = snapshotter.take({"weight": weight}, deferred={"weight"}, aside={"w": piece})
            pending.finish_copy()
            assert torch.equal(pending.aside["w"], torch.arange(begin, end, dtype=torch.float32))
            assert snapshotter.staging_bytes(gpu.device) >= 8192 * 4
    assert len([r for r in caplog.records if r.getMessage().startswith("snapshots of")]) == 1  # chosen once
