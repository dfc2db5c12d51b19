"""Under ``torchrun``: ResumableLoaders built before ``init_process_group``.

* one first iterated after the process group exists partitions by the job's rank: each rank
  prints ``rank=R indices=...``;
* one iterated before it (so partitioned for one process) and again after it raises
  ``TopologyError``: each rank prints ``rank=R topology error: ...``.
"""

from __future__ import annotations

import torch.distributed as dist
from worker_exit import exit_without_teardown  # beside this script

from checkfreq.data import ResumableLoader
from checkfreq.errors import TopologyError


def main() -> None:
    fresh = ResumableLoader(list(range(12)), batch_size=2, shuffle=True, seed=3)
    early = ResumableLoader(list(range(12)), batch_size=2)
    next(iter(early))  # a pass started without a process group: one process takes every sample
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    indices = [int(i) for batch in fresh for i in batch]
    print(f"rank={rank} indices={' '.join(map(str, indices))}", flush=True)
    try:
        next(iter(early))
        print(f"rank={rank} no error", flush=True)
    except TopologyError as e:
        print(f"rank={rank} topology error: {e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
