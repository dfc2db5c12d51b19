"""The writer's deferred copies: exact bytes, and no second OpenMP team beside the training loop's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from checkfreq.pipeline.capture import snapshot
from checkfreq.pipeline.capture.snapshot import DEFERRED_COPY_PIECE_BYTES, PendingSnapshot, Snapshotter, layout_of

SOURCES = {
    "float32": lambda: torch.randn(1000, 37),
    "bfloat16": lambda: torch.randn(64, 64).to(torch.bfloat16),
    "int64": lambda: torch.arange(-5000, 5000, dtype=torch.int64),
    "transposed": lambda: torch.randn(40, 30).t(),
    "conj": lambda: torch.randn(8, 8, dtype=torch.complex64).conj(),  # lazily conjugated
    "neg": lambda: torch.randn(8, 8)._neg_view(),  # lazily negated
    "empty": lambda: torch.empty(0, 3),
    "several pieces": lambda: torch.randn(3 * DEFERRED_COPY_PIECE_BYTES // 4 + 123),
}


def _pending(sources: list[torch.Tensor]) -> tuple[PendingSnapshot, list[torch.Tensor]]:
    slots = [torch.full(src.shape, 7, dtype=src.dtype) for src in sources]
    return PendingSnapshot(None, torch.empty(0), list(zip(slots, sources, strict=True))), slots  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", SOURCES)
def test_deferred_copies_are_exact(kind: str) -> None:
    src = SOURCES[kind]()
    pending, (slot,) = _pending([src])
    pending.finish_copy()
    assert pending.copied.is_set() and torch.equal(slot, src.resolve_conj().resolve_neg())


def test_the_fence_and_the_writer_share_the_pieces() -> None:
    """Both threads claim pieces; each piece is copied once and every byte arrives."""
    sources = [torch.randn(DEFERRED_COPY_PIECE_BYTES // 4 * 5 + 7), torch.arange(10**6), torch.randn(300, 200).t()]
    pending, slots = _pending(sources)
    writer = threading.Thread(target=pending.finish_copy)
    writer.start()
    pending.copy_pieces()  # what the fence does
    writer.join()
    assert pending.copied.is_set()
    for slot, src in zip(slots, sources, strict=True):
        assert torch.equal(slot, src)


def test_the_fence_alone_can_do_every_copy() -> None:
    """If the writer has not started yet, the training thread copies everything and the writer finds nothing left."""
    sources = [torch.randn(DEFERRED_COPY_PIECE_BYTES // 2 + 1) for _ in range(4)]
    pending, slots = _pending(sources)
    pending.copy_pieces()
    assert not pending.copied.is_set()  # only the writer releases the fence: it may have CUDA copies too
    pending.finish_copy()
    assert pending.copied.is_set() and all(torch.equal(a, b) for a, b in zip(slots, sources, strict=True))


def test_a_failed_copy_fails_the_persist_and_releases_the_fence() -> None:
    def broken() -> PendingSnapshot:  # a pair that copy_ cannot broadcast
        return PendingSnapshot(None, torch.empty(0), [(torch.empty(3), torch.randn(5, 4).t())])  # type: ignore[arg-type]

    in_writer = broken()
    with pytest.raises(RuntimeError, match="size of tensor"):
        in_writer.finish_copy()
    assert in_writer.copied.is_set()
    in_fence = broken()
    with pytest.raises(RuntimeError, match="size of tensor"):
        in_fence.copy_pieces()
    with pytest.raises(RuntimeError, match="deferred snapshot copy failed"):
        in_fence.finish_copy()  # the writer must not persist a buffer with a piece missing
    assert in_fence.copied.is_set()


THREADS_AFTER_A_CHECKPOINT = textwrap.dedent(
    """
    import os, sys, torch
    import checkfreq as cf
    torch.set_num_threads(2)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = torch.optim.Adam(model.parameters())
    def step():
        model(torch.randn(256, 512)).square().mean().backward()
        opt.step()
    with cf.Checkpointer(sys.argv[1], policy=10**6, model=model, optimizer=opt) as ckpt:
        step()  # the training loop's own OpenMP team starts here
        before = len(os.listdir("/proc/self/task"))
        for _ in range(3):
            ckpt.save()  # parameters and Adam state: copied by the writer behind the fence
            step()
            ckpt.wait()
        print(before, len(os.listdir("/proc/self/task")))
    """
)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2, reason="needs Linux and 2 cores")
def test_the_writer_copies_without_starting_threads(tmp_path) -> None:
    """A multi-threaded ``copy_`` in the writer would start an OpenMP team there that competes with training."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", THREADS_AFTER_A_CHECKPOINT, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    before, after = map(int, out.split())
    assert after == before, f"{after - before} threads appeared while the writer copied"


def test_the_writer_copies_before_the_first_commit_round(tmp_path) -> None:
    """The writer joins the deferred copies before round 1 of the commit (creating the staging
    location; a collective under torch.distributed), so the fence never copies alone while the
    writer waits on the other ranks or the store. The checkpoint is still committed whole."""
    from checkfreq.pipeline.capture.snapshot import Snapshotter
    from checkfreq.pipeline.retention.retainer import Retainer
    from checkfreq.pipeline.save.commit import CommitJob, Committer
    from checkfreq.policies.retention import Retention
    from checkfreq.ranks.collectives import Solo
    from checkfreq.storage.local import LocalStore

    tensors = {"a": torch.randn(DEFERRED_COPY_PIECE_BYTES // 4 * 3 + 5), "b": torch.arange(1000)}
    pending = Snapshotter().take(tensors, deferred=set(tensors))
    copied_when_preparing: list[bool] = []

    class Recording(LocalStore):
        def staging_dir(self, step: int, token: str, *, create: bool = True):  # type: ignore[override]
            copied_when_preparing.append(pending.copied.is_set())
            return super().staging_dir(step, token, create=create)

    store = Recording(tmp_path)
    committer = Committer(store, Solo(), leader=True, token="t", retainer=Retainer(store, Retention(1), leader=True))
    result = committer.run(CommitJob(3, None, pending, {}, None, {}, 0.0))
    assert copied_when_preparing and all(copied_when_preparing)
    assert result.step == 3 and dict(store.checkpoints())


def test_the_writer_cuts_the_deferred_copies_into_pieces_not_the_training_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The per-tensor work of a deferred copy runs on the first thread that copies: the writer, as a rule."""
    cut_on: list[str] = []
    cut = snapshot._pieces

    def recording(dst: torch.Tensor, src: torch.Tensor) -> list[snapshot.CopyPiece]:
        cut_on.append(threading.current_thread().name)
        return cut(dst, src)

    monkeypatch.setattr(snapshot, "_pieces", recording)
    sources = [torch.randn(100) for _ in range(50)]
    pending, slots = _pending(sources)
    assert cut_on == []  # taking the snapshot cut nothing
    writer = threading.Thread(target=pending.finish_copy, name="writer")
    writer.start()
    writer.join()
    assert cut_on == ["writer"] * len(sources)
    assert all(torch.equal(a, b) for a, b in zip(slots, sources, strict=True))
    pending.copy_pieces()  # the fence, late: nothing left to cut or copy
    assert cut_on == ["writer"] * len(sources)


def test_a_session_plans_its_layout_once_and_again_only_when_a_shape_changes() -> None:
    snapshotter = Snapshotter()
    state = {"w": torch.zeros(4, 4), "b": torch.zeros(4), "step": torch.zeros((), dtype=torch.int64)}
    first = snapshotter.layout_of(state)
    assert snapshotter.layout_of(dict(state)) is first  # the same names, dtypes and shapes: the same plan
    assert first == layout_of(state)
    share = {"w": state["w"]}  # a tier's share of the state, planned beside the checkpoint's
    assert snapshotter.layout_of(share) is snapshotter.layout_of(share)
    assert snapshotter.layout_of(state) is first
    grown = {**state, "w": torch.zeros(4, 5)}
    assert snapshotter.layout_of(grown) is not first and snapshotter.layout_of(grown).nbytes == first.nbytes + 16
    retyped = {**state, "b": torch.zeros(4, dtype=torch.float64)}
    assert snapshotter.layout_of(retyped).signature != first.signature
