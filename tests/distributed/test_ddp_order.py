"""A restore at three ranks or more warns when DDP will rebuild its gradient buckets, which makes the
first iteration after the restore round differently (docs/exactness.md, "Under DDP"); with
``find_unused_parameters=True`` (no rebuild) it does not. Real gloo ranks."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from checkfreq import Checkpointer
from checkfreq.ranks.ddp_order import ddp_wrappers, warn_if_buckets_reorder
from helpers import make_model, spawn_ranks

WARNING = "rebuilds its gradient buckets"
CASES = {"wrapped": (False, "module"), "ddp-registered": (False, "ddp"), "nested": (False, "nested"),
         "find-unused": (True, "module")}
"""name: (find_unused_parameters, what is registered: the module DDP wraps, the DDP itself, or a module
that DDP wraps inside a framework's wrapper, as Lightning does)"""


class _FrameworkWrapper(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _restore_cases(rank: int, world: int, workdir: str) -> None:
    """For each case, save once and restore into a fresh Checkpointer; count checkfreq's warnings."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{workdir}/store", world), rank=rank, world_size=world)
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("checkfreq").addHandler(handler)
    counts = {}
    for name, (find_unused, registered_kind) in CASES.items():
        model = make_model()
        wrapped = _FrameworkWrapper(model) if registered_kind == "nested" else model
        ddp = torch.nn.parallel.DistributedDataParallel(wrapped, find_unused_parameters=find_unused)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        registered = ddp if registered_kind == "ddp" else model
        assert ddp_wrappers([registered]) == [ddp] and ddp_wrappers([make_model()]) == []
        assert not warn_if_buckets_reorder([registered], 2)  # two ranks' sums do not depend on the order
        with Checkpointer(f"{workdir}/{name}", policy=1000, model=registered, optimizer=optimizer) as ckpt:
            ddp(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            ckpt.step()
            ckpt.save(blocking=True)
        warnings.clear()
        with Checkpointer(f"{workdir}/{name}", policy=1000, model=registered, optimizer=optimizer) as ckpt:
            assert ckpt.restore() == 1
        counts[name] = sum(WARNING in w for w in warnings)
    Path(f"{workdir}/warned{rank}.json").write_text(json.dumps(counts))
    dist.destroy_process_group()


def test_restore_at_three_ranks_warns_when_ddp_reorders_its_buckets(tmp_path: Path) -> None:
    spawn_ranks(_restore_cases, (3, str(tmp_path)), 3)
    expected = {"wrapped": 1, "ddp-registered": 1, "nested": 1, "find-unused": 0}
    assert [json.loads((tmp_path / f"warned{rank}.json").read_text()) for rank in range(3)] == [expected] * 3


def test_looking_for_ddp_wrappers_emits_no_warning() -> None:
    """The search walks every object the garbage collector tracks, ``torch.distributed.reduce_op``
    (deprecated, warns when its class is read) among them: a user's restore must not print that."""
    model = make_model()
    assert dist.reduce_op is not None  # the deprecated object exists in this process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ddp_wrappers([model]) == []
    assert [str(w.message) for w in caught] == []
