"""A restore at three ranks or more gives DDP the gradient buckets the checkpoint recorded, however
the model is registered: the module DDP wraps, the DDP itself, or a module DDP wraps inside a
framework's wrapper (as Lightning's); a DDP with ``find_unused_parameters=True`` never rebuilds and
is left as it is. Real gloo ranks."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from checkfreq import Checkpointer
from checkfreq.ranks.compat import ddp_logging_data
from checkfreq.ranks.ddp_order import ddp_wrappers_by_name
from helpers import spawn_ranks

CASES = {
    "wrapped": (False, "module"),
    "ddp-registered": (False, "ddp"),
    "nested": (False, "nested"),
    "find-unused": (True, "module"),
}
"""name: (find_unused_parameters, what is registered: the module DDP wraps, the DDP itself, or a module
that DDP wraps inside a framework's wrapper, as Lightning does)"""


class _Reversed(torch.nn.Module):
    """Layers used in the other order than registered: DDP's rebuilt buckets differ from its first ones."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.b(x))


class _FrameworkWrapper(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _ddp(
    find_unused: bool, registered_kind: str
) -> tuple[torch.nn.Module, torch.nn.parallel.DistributedDataParallel, torch.optim.Optimizer]:
    model = _Reversed()
    wrapped = _FrameworkWrapper(model) if registered_kind == "nested" else model
    ddp = torch.nn.parallel.DistributedDataParallel(wrapped, find_unused_parameters=find_unused, bucket_cap_mb=0.0003)
    return ddp if registered_kind == "ddp" else model, ddp, torch.optim.SGD(model.parameters(), lr=0.1)


def _restore_cases(rank: int, world: int, workdir: str) -> None:
    """For each case: three steps (DDP rebuilds at the second forward, its logger reports it after the
    second backward), a checkpoint, then a fresh DDP restored from it; each DDP's buckets, as its logger says."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{workdir}/store", world), rank=rank, world_size=world)
    buckets = {}
    for name, (find_unused, registered_kind) in CASES.items():
        registered, ddp, optimizer = _ddp(find_unused, registered_kind)
        assert ddp_wrappers_by_name({"model": registered}) == {"model": [ddp]}
        with Checkpointer(f"{workdir}/{name}", policy=1000, model=registered, optimizer=optimizer) as ckpt:
            for _ in range(3):
                ddp(torch.randn(4, 8)).sum().backward()
                optimizer.step()
                ckpt.step()
            ckpt.save(blocking=True)
        trained = ddp_logging_data(ddp).get("rebuilt_per_bucket_param_indices")
        registered, ddp, optimizer = _ddp(find_unused, registered_kind)
        first = ddp_logging_data(ddp).get("bucket_sizes")
        with Checkpointer(f"{workdir}/{name}", policy=1000, model=registered, optimizer=optimizer) as ckpt:
            assert ckpt.restore() == 3
        buckets[name] = [trained, first, ddp_logging_data(ddp).get("bucket_sizes")]
    Path(f"{workdir}/buckets{rank}.json").write_text(json.dumps(buckets))
    dist.destroy_process_group()


def test_a_restore_at_three_ranks_gives_ddp_the_buckets_it_had_rebuilt(tmp_path: Path) -> None:
    spawn_ranks(_restore_cases, (3, str(tmp_path)), 3)
    seen = [json.loads((tmp_path / f"buckets{rank}.json").read_text()) for rank in range(3)]
    assert seen[0] == seen[1] == seen[2]
    for name in ("wrapped", "ddp-registered", "nested"):
        trained, first, restored = seen[0][name]
        assert trained is not None and len(trained.split(", ")) == 2, (name, trained)  # rebuilt into two buckets
        assert len(first.split(", ")) == 1 and len(restored.split(", ")) == 2, (name, first, restored)
    trained, first, restored = seen[0]["find-unused"]
    assert trained is None and restored == first  # never rebuilt, left as it is


def test_looking_for_ddp_wrappers_emits_no_warning() -> None:
    """The search walks every object the garbage collector tracks, ``torch.distributed.reduce_op``
    (deprecated, warns when its class is read) among them: a user's restore must not print that."""
    model = _Reversed()
    assert dist.reduce_op is not None  # the deprecated object exists in this process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ddp_wrappers_by_name({"model": model}) == {}
    assert [str(w.message) for w in caught] == []
