"""DistributedDataParallel's gradient buckets after a restore, at three ranks or more.

DDP sums gradients in flat buckets. After its first iteration it rebuilds them in the order the
gradients became ready (unless ``find_unused_parameters=True``), which can move a parameter to
another place in its bucket. Where a tensor lies in the bucket decides, at three ranks or more, in
which order an all-reduce adds the ranks' values, and floating-point sums round differently in
another order (two ranks' ``a + b`` is the same either way). A resumed process starts with the
initial buckets again: where the rebuild had changed them, its first iteration rounds differently
from the uninterrupted run's, and the run is no longer bit-identical (it still trains correctly).
Whether it had cannot be told before the iteration runs, so a restore warns whenever it may.
With ``find_unused_parameters=True`` DDP never rebuilds its buckets, so both runs reduce alike.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterable

from torch import nn

log = logging.getLogger("checkfreq.ddp_order")


def ddp_wrappers(modules: Iterable[nn.Module]) -> list[nn.parallel.DistributedDataParallel]:
    """The live DDP modules that are, or wrap at any depth (a framework's own wrapper between
    them), one of ``modules``: found among the garbage collector's objects, once per restore.

    Each object's type is tested with ``issubclass(type(obj), ...)``: ``isinstance`` reads
    ``obj.__class__``, which on ``torch.distributed.reduce_op`` emits a deprecation warning."""
    wanted = {id(m) for m in modules}
    if not wanted:
        return []
    return [obj for obj in gc.get_objects() if issubclass(type(obj), nn.parallel.DistributedDataParallel)
            and (id(obj) in wanted or any(id(sub) in wanted for sub in obj.module.modules()))]


def warn_if_buckets_reorder(modules: Iterable[nn.Module], world_size: int) -> bool:
    """Warn (and return True) when a restored run at ``world_size`` >= 3 trains through a DDP that
    rebuilds its buckets: its first iteration after the restore may not be bit-identical."""
    if world_size < 3:
        return False
    rebuilding = [ddp for ddp in ddp_wrappers(modules) if not ddp.find_unused_parameters]
    if rebuilding:
        log.warning(
            "DistributedDataParallel with find_unused_parameters=False at %d ranks: it rebuilds its gradient "
            "buckets after its first iteration, so the first iteration after this restore may sum the ranks' "
            "gradients in another order than the uninterrupted run did, and the resumed run then differs from it "
            "in the last bits. Construct DDP with find_unused_parameters=True for bit-identical resumes "
            "(docs/exactness.md).",
            world_size,
        )
    return bool(rebuilding)
