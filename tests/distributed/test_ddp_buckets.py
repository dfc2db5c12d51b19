"""A resumed DDP given the gradient buckets recorded at the checkpoint (``BucketLayouts``) trains
bit-identically to the uninterrupted run at three and four ranks; without them it does not (its
first iteration reduces with DDP's initial buckets). Real gloo ranks, each with data of its own."""

from __future__ import annotations

import copy
import gc
import json
import logging
import multiprocessing
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from checkfreq.ranks import ddp_buckets
from checkfreq.ranks.ddp_buckets import BucketLayouts

DDP = nn.parallel.DistributedDataParallel
STEPS = 6
CAP_MB = 0.003
"""Under one layer's weight and bias (2,400 bytes) with another layer's: a few buckets, in the gradients' order."""


class _Net(nn.Module):
    """Layers registered a, b, c and used b, c, a: the rebuilt buckets differ from the initial ones."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(24, 24), nn.Linear(24, 24), nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(torch.tanh(self.c(torch.tanh(self.b(x)))))


def _build(seed: int, **ddp_options: Any) -> tuple[_Net, DDP, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _Net()
    ddp = DDP(model, bucket_cap_mb=CAP_MB, **ddp_options)
    return model, ddp, torch.optim.Adam(model.parameters(), lr=0.01)


def _train(ddp: nn.Module, optimizer: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(16, 24, generator=generator), torch.randn(16, 24, generator=generator)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()


def _resume(
    model: nn.Module, optimizer: torch.optim.Optimizer, recorded: dict | None, world: int, *, register_ddp: bool = False
) -> tuple[_Net, DDP, torch.optim.Optimizer, BucketLayouts]:
    """A fresh model, DDP and optimizer loaded with ``model``'s and ``optimizer``'s state, as a new process
    would build them; the recorded buckets replayed (``recorded`` not None) into the module or the DDP
    registered as ``"model"``."""
    state = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    model, ddp, optimizer = _build(seed=1)
    model.load_state_dict(state[0])
    optimizer.load_state_dict(state[1])
    layouts = BucketLayouts({"model": ddp if register_ddp else model, "optimizer": optimizer}, world)
    if recorded is not None:
        layouts.replay(json.loads(json.dumps(recorded)))
    return model, ddp, optimizer, layouts


def _buckets(ddp: DDP) -> str:
    return ddp._get_ddp_logging_data()["bucket_sizes"]


def _ranks_run(rank: int, world: int, workdir: str) -> None:
    """Uninterrupted; resumed at step 3 without replay; resumed at 3 with replay, then again at 4 (the
    resumed DDP's first iteration: it records the buckets replayed), checking where DDP's rebuild lands;
    DDPs left alone; a foreign layout; a layout the reducer refuses."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{workdir}/store", world), rank=rank, world_size=world)
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("checkfreq").addHandler(handler)
    out: dict[str, Any] = {}

    model, ddp, optimizer = _build(seed=0)
    _train(ddp, optimizer, rank, range(STEPS))
    reference = [p.detach().clone() for p in model.parameters()]

    def same(m: nn.Module) -> bool:
        return all(torch.equal(p, q) for p, q in zip(m.parameters(), reference, strict=True))

    model, ddp, optimizer = _build(seed=0)
    layouts = BucketLayouts({"model": model}, world)
    _train(ddp, optimizer, rank, range(2))
    out["recorded_at_2"] = layouts.record()  # rebuilt at the second forward: its logger is asked to report it
    _train(ddp, optimizer, rank, range(2, 3))
    recorded = layouts.record()
    out["recorded"], out["initial"] = recorded, _buckets(ddp)

    control, control_ddp, control_optimizer, _ = _resume(model, optimizer, None, world)
    _train(control_ddp, control_optimizer, rank, range(3, STEPS))
    out["without_replay_equal"] = same(control)

    model, ddp, optimizer, layouts = _resume(model, optimizer, recorded, world)
    out["replayed_buckets"] = _buckets(ddp)
    _train(ddp, optimizer, rank, range(3, 4))
    out["recorded_at_4"] = layouts.record()  # the replayed DDP's rebuild is pending: record() knows its buckets
    model, ddp, optimizer, layouts = _resume(model, optimizer, out["recorded_at_4"], world, register_ddp=True)
    _train(ddp, optimizer, rank, range(4, STEPS))
    out["with_replay_equal"] = same(model)
    out["recorded_at_6"] = layouts.record()  # DDP rebuilt at its second forward; its logger reports it at the next
    warnings[:] = []
    ddp(torch.zeros(1, 24))
    out["rebuilt_after_replay"] = (layouts.record(), warnings[:])

    model, ddp, optimizer = _build(seed=0)  # buckets its own rebuild does not land on: a warning once it reports
    layouts = BucketLayouts({"model": model}, world)
    layouts.replay({"model": [bucket[::-1] for bucket in recorded["model"]]})
    _train(ddp, optimizer, rank, range(3))
    out["rebuilt_elsewhere"] = (layouts.record(), warnings[:])

    out["left_alone"] = {}
    for case, options in {
        "static_graph": {"static_graph": True},
        "find_unused": {"find_unused_parameters": True},
        "comm_hook": {},
    }.items():
        model, ddp, optimizer = _build(seed=0, **options)
        if case == "comm_hook":
            ddp.register_comm_hook(None, allreduce_hook)
        _train(ddp, optimizer, rank, range(3))
        reducer = ddp.reducer
        BucketLayouts({"model": model}, world).replay(recorded)
        out["left_alone"][case] = (BucketLayouts({"model": model}, world).record(), ddp.reducer is reducer)
    model, ddp, optimizer = _build(seed=0)
    reducer, warnings[:] = ddp.reducer, []
    BucketLayouts({"model": model}, world).replay({"model": [[0, 1], [2, 3]]})
    out["foreign"] = (ddp.reducer is reducer, warnings[:])
    torch.manual_seed(0)
    model = _Net()
    model.a.double()  # a bucket of float64 and float32 gradients: the reducer refuses it
    ddp, warnings[:] = DDP(model, bucket_cap_mb=CAP_MB), []
    reducer, logger = ddp.reducer, ddp.logger
    BucketLayouts({"model": model}, world).replay({"model": [[0, 1, 2, 3, 4, 5]]})
    out["mixed_dtypes"] = (ddp.reducer is reducer and ddp.logger is logger, warnings[:])
    Path(f"{workdir}/rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def _start_ranks(fn: Any, args: tuple[Any, ...], nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes forked from a server that imported torch once (as in
    tests/integration/test_epoch_end_loops.py): a rank starts at once, not after seconds of imports.
    A forked child leaves with ``os._exit``, without the interpreter's teardown (tests/scripts/worker_exit.py)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "torch._dynamo", "checkfreq"])
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


@pytest.mark.parametrize("world", [3, 4])
def test_replayed_buckets_make_a_resumed_ddp_bit_identical(tmp_path: Path, world: int) -> None:
    _start_ranks(_ranks_run, (world, str(tmp_path)), world)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)]
    recorded = results[0]["recorded"]
    assert list(recorded) == ["model"] and len(recorded["model"]) > 1
    for out in results:
        assert out["recorded"] == recorded  # DDP broadcast rank 0's buckets
        assert out["recorded_at_2"] == recorded  # asked of the logger before its own report
        assert out["without_replay_equal"] is False  # the control: DDP's initial buckets round otherwise
        assert out["replayed_buckets"] != out["initial"]  # the new reducer's buckets are the recorded ones
        assert out["recorded_at_4"] == recorded == out["recorded_at_6"]
        assert out["with_replay_equal"] is True
        assert out["rebuilt_after_replay"] == [recorded, []]  # DDP's own rebuild landed on the replayed buckets
        assert out["rebuilt_elsewhere"][0] == recorded and len(out["rebuilt_elsewhere"][1]) == 1
        assert "to others than those recorded" in out["rebuilt_elsewhere"][1][0]
        assert out["left_alone"] == {case: [{}, True] for case in ("static_graph", "find_unused", "comm_hook")}
        assert out["foreign"][0] is True and len(out["foreign"][1]) == 1
        assert "not a partition" in out["foreign"][1][0]
        assert out["mixed_dtypes"][0] is True and len(out["mixed_dtypes"][1]) == 1
        assert "could not give" in out["mixed_dtypes"][1][0] and "dtype" in out["mixed_dtypes"][1][0]


def test_below_three_ranks_nothing_is_looked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks' sums do not depend on the order: no pass over the garbage collector's objects."""

    def scan(*args: object) -> None:
        raise AssertionError("looked for DDPs")

    monkeypatch.setattr(ddp_buckets, "ddp_wrappers_by_name", scan)
    layouts = BucketLayouts({"model": _Net()}, world_size=2)
    assert layouts.record() == {}
    layouts.replay({"model": [[0, 1, 2, 3, 4, 5]]})


def test_ddps_are_looked_for_once_and_held_weakly(monkeypatch: pytest.MonkeyPatch) -> None:
    """One pass over the garbage collector's objects per BucketLayouts, at its first use; the modules
    are not kept alive by it. Without a DDP nothing is recorded, and a replay does nothing."""
    scans: list[list[str]] = []

    def scan(modules: dict[str, nn.Module]) -> dict:
        scans.append(list(modules))
        return wrappers(modules)

    wrappers = ddp_buckets.ddp_wrappers_by_name
    monkeypatch.setattr(ddp_buckets, "ddp_wrappers_by_name", scan)
    model = _Net()
    layouts = BucketLayouts({"model": model, "step": 3}, world_size=4)
    assert scans == []
    assert layouts.record() == {}
    layouts.replay({"model": [[0, 1, 2, 3, 4, 5]]})
    assert layouts.record() == {}
    assert scans == [["model"]]
    watch = weakref.ref(model)
    del model
    gc.collect()
    assert watch() is None
