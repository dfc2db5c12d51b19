"""The torch APIs whose place or presence depends on the torch version, behind one small module.

checkfreq supports torch >= 2.6 (see pyproject.toml): the public ``torch.distributed.tensor``
(DTensor) and ``torch.distributed.fsdp.fully_shard`` (FSDP2) exist from there on. The few
private APIs used are reached only here, each with an error that names what is missing (DDP's
reducer: see :mod:`checkfreq.ranks.ddp_buckets`); where
gloo cannot connect its pairs of ranks on demand (before torch 2.8), checkfreq's groups connect
every pair at creation instead, as ``dist.new_group`` does (logged once).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from checkfreq.errors import UnsupportedTorchError

log = logging.getLogger("checkfreq.compat")

MINIMUM_TORCH = (2, 6)
_LAZY_GLOO = "checkfreq_lazy_gloo"


def _missing(what: str, error: Exception) -> UnsupportedTorchError:
    return UnsupportedTorchError(
        f"{what} is not available in torch {torch.__version__} ({type(error).__name__}: {error}); "
        f"checkfreq needs torch >= {'.'.join(map(str, MINIMUM_TORCH))}"
    )


def dtensor_class() -> Any:
    """``torch.distributed.tensor.DTensor``."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError as e:
        raise _missing("torch.distributed.tensor.DTensor", e) from e
    return DTensor


def dtensor_local_box(target: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, shape) of this rank's block of the DTensor ``target`` in its global tensor."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError as e:
        raise _missing("DTensor's compute_local_shape_and_global_offset", e) from e
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    return tuple(offset), tuple(shape)


def default_store() -> dist.Store:
    """The key-value store of the default process group (the one torchrun's rendezvous set up)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store
    except ImportError as e:
        raise _missing("the default process group's store", e) from e
    return _get_default_store()


def gloo_group_on_store(store: dist.Store, timeout: timedelta, description: str) -> dist.ProcessGroup:
    """A gloo group of every rank that meets its peers through ``store``, lazily connected where torch can.

    ``dist.new_group`` always rendezvouses in the default group's store, under a name of its own
    choosing; this is the same creation with the store given (see :mod:`checkfreq.ranks.groups`). Each
    rank publishes its address under ``store`` at once; with torch >= 2.8 two ranks connect only
    when they first exchange a message, and look each other's address up under ``store`` then
    (:func:`lazy_gloo_backend`); with an older torch every pair connects now.
    """
    try:
        from torch.distributed.distributed_c10d import _new_process_group_helper, _process_group_name, _world
    except ImportError as e:
        raise _missing("process group creation on a given store", e) from e
    ranks = list(range(dist.get_world_size()))
    name = _process_group_name(ranks, use_hashed_name=False)
    try:
        group, _ = _new_process_group_helper(
            len(ranks),
            dist.get_rank(),
            ranks,
            lazy_gloo_backend() or dist.Backend.GLOO,
            store,
            name,
            timeout=timeout,
            group_desc=description,
        )
    except TypeError as e:  # another signature
        raise _missing("process group creation on a given store", e) from e
    _world.pg_group_ranks[group] = {rank: rank for rank in ranks}
    return group


@functools.cache
def lazy_gloo_backend() -> str | None:
    """The name of a gloo backend whose pairs of ranks connect on their first message, registered
    with torch once; None (logged once) where this torch cannot create one (before 2.8)."""
    try:
        from torch.distributed import ProcessGroupGloo

        ProcessGroupGloo.create_default_device(lazy_init=True)
        ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private: this module is where such calls live
        dist.Backend.register_backend(_LAZY_GLOO, _lazy_gloo, devices=["cpu"])
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        log.info(
            "torch %s cannot connect gloo pairs on demand (%s): checkfreq's groups connect every pair of "
            "ranks when they are created",
            torch.__version__,
            e,
        )
        return None
    return _LAZY_GLOO


def _lazy_gloo(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroupGloo:
    """A gloo backend on ``store`` whose device connects a pair of ranks when the pair first talks."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._threads = 2  # torch's default for one device
    options._devices = [dist.ProcessGroupGloo.create_default_device(lazy_init=True)]
    return dist.ProcessGroupGloo(store, rank, size, options)


def ddp_logging_data(ddp: nn.parallel.DistributedDataParallel) -> dict[str, Any]:
    """What DDP's logger reports (``_get_ddp_logging_data``): its construction, and at its sampled
    iterations (the first ten, then one in 100) the reducer's state, its rebuilt buckets among it.

    A DDP that has rebuilt its buckets (at its second forward) but whose logger has not reported it
    yet (it does one iteration later) is asked to report now (``set_runtime_stats_and_log``), so a
    checkpoint of its second step holds its buckets too."""
    data = ddp._get_ddp_logging_data()
    logger = getattr(ddp, "logger", None)
    reported = "rebuilt_per_bucket_param_indices" in data
    if getattr(ddp, "_has_rebuilt_buckets", False) and logger is not None and not reported:
        logger.set_runtime_stats_and_log()
        data = ddp._get_ddp_logging_data()
    return data


def ddp_without_reducer(ddp: nn.parallel.DistributedDataParallel) -> bool:
    """Whether ``ddp`` reduces its gradients without its C++ reducer's buckets (compiled autograd's
    Python reducer, or every parameter's all-reduce delayed to hooks of its own)."""
    return bool(getattr(ddp, "_use_python_reducer", False) or getattr(ddp, "_delay_all_reduce_all_params", False))


def rebuild_ddp_reducer(ddp: nn.parallel.DistributedDataParallel, buckets: Sequence[Sequence[int]]) -> None:
    """Give ``ddp`` a new reducer (and logger) whose buckets are ``buckets`` (parameter indices, in
    the order they are reduced) from its first iteration on, and take the old reducer's autograd hooks away.

    DDP's ``_ddp_init_helper`` builds the reducer, as at construction and in ``__setstate__``, with
    this torch's arguments; only the bucket assignment it computes is replaced by ``buckets`` (it
    reverses the list it gets). On an error (a bucket mixing dtypes or devices) ``ddp`` keeps its reducer.
    """
    asked: list[bool] = []

    def given(*args: Any, **kwargs: Any) -> tuple[list[list[int]], list[int]]:
        asked.append(True)
        return [list(bucket) for bucket in reversed(buckets)], [ddp.bucket_bytes_cap] * len(buckets)

    try:
        parameters, expect_sparse = ddp._build_params_for_reducer()
        names = ddp._build_debug_param_to_name_mapping(parameters)
    except AttributeError as e:
        raise _missing("DistributedDataParallel's reducer parameters", e) from e
    old_reducer, old_logger = ddp.reducer, ddp.logger
    assign = dist._compute_bucket_assignment_by_size
    dist._compute_bucket_assignment_by_size = given  # for the next line only
    try:
        ddp._ddp_init_helper(parameters, expect_sparse, names, False)
    except Exception as e:
        ddp.reducer, ddp.logger = old_reducer, old_logger
        if isinstance(e, (AttributeError, TypeError)):  # another _ddp_init_helper
            raise _missing("DistributedDataParallel._ddp_init_helper", e) from e
        raise
    finally:
        dist._compute_bucket_assignment_by_size = assign
    old_reducer._remove_autograd_hooks()
    ddp._has_rebuilt_buckets = False
    if not asked:  # the new reducer has DDP's initial buckets, as a new DDP would
        raise _missing("a bucket assignment in DistributedDataParallel._ddp_init_helper", LookupError("not asked"))
