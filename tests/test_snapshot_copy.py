"""The writer's deferred copies: exact bytes, and no second OpenMP team beside the training loop's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from checkfreq.snapshot import copy_on_this_thread


@pytest.mark.parametrize(
    "src",
    [
        torch.randn(1000, 37),
        torch.randn(64, 64).to(torch.bfloat16),
        torch.arange(-5000, 5000, dtype=torch.int64),
        torch.randn(40, 30).t(),  # strided
        torch.randn(8, 8, dtype=torch.complex64).conj(),  # lazily conjugated
        torch.randn(8, 8)._neg_view(),  # lazily negated
        torch.empty(0, 3),
    ],
    ids=["float32", "bfloat16", "int64", "transposed", "conj", "neg", "empty"],
)
def test_copy_on_this_thread_is_exact(src: torch.Tensor) -> None:
    dst = torch.full(src.shape, 7, dtype=src.dtype)
    copy_on_this_thread(dst, src)
    assert torch.equal(dst, src.resolve_conj().resolve_neg())


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
    out = subprocess.run([sys.executable, "-c", THREADS_AFTER_A_CHECKPOINT, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    before, after = map(int, out.split())
    assert after == before, f"{after - before} threads appeared while the writer copied"
