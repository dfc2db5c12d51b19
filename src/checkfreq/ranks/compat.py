"""The torch APIs whose place or presence depends on the torch version, behind one small module.

checkfreq supports torch >= 2.6 (see pyproject.toml): the public ``torch.distributed.tensor``
(DTensor) and ``torch.distributed.fsdp.fully_shard`` (FSDP2) exist from there on. The few
private APIs used are reached only here, each with an error that names what is missing; where
gloo cannot connect its pairs of ranks on demand (before torch 2.8), checkfreq's groups connect
every pair at creation instead, as ``dist.new_group`` does (logged once).
"""

from __future__ import annotations

import functools
import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

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
            len(ranks), dist.get_rank(), ranks, lazy_gloo_backend() or dist.Backend.GLOO, store, name, timeout=timeout,
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
        log.info("torch %s cannot connect gloo pairs on demand (%s): checkfreq's groups connect every pair of "
                 "ranks when they are created", torch.__version__, e)
        return None
    return _LAZY_GLOO


def _lazy_gloo(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroupGloo:
    """A gloo backend on ``store`` whose device connects a pair of ranks when the pair first talks."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._threads = 2  # torch's default for one device
    options._devices = [dist.ProcessGroupGloo.create_default_device(lazy_init=True)]
    return dist.ProcessGroupGloo(store, rank, size, options)
