"""The DistributedDataParallel modules that train the registered modules.

A registered module may be the DDP itself, the module it wraps, or a module nested deeper (a
framework's own wrapper between them, as Lightning's). DDP's gradient buckets after a restore
(:mod:`checkfreq.ranks.ddp_buckets`) need the DDP, which nothing registered points to: it is found
among the garbage collector's objects, once per Checkpointer.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping

from torch import nn


def ddp_wrappers_by_name(modules: Mapping[str, nn.Module]) -> dict[str, list[nn.parallel.DistributedDataParallel]]:
    """For each name of ``modules`` that a live DDP is or wraps at any depth, those DDPs: one pass
    over the garbage collector's objects (about 0.15 s in a large process).

    Each object's type is tested with ``issubclass(type(obj), ...)``: ``isinstance`` reads
    ``obj.__class__``, which on ``torch.distributed.reduce_op`` emits a deprecation warning."""
    names: dict[int, list[str]] = {}
    for name, module in modules.items():
        names.setdefault(id(module), []).append(name)
    found: dict[str, list[nn.parallel.DistributedDataParallel]] = {}
    if not names:
        return found
    for obj in gc.get_objects():
        if issubclass(type(obj), nn.parallel.DistributedDataParallel):
            for name in {name for sub in obj.modules() for name in names.get(id(sub), ())}:
                found.setdefault(name, []).append(obj)
    return found


__all__ = ["ddp_wrappers_by_name"]
