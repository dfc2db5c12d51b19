"""A torchrun job that constructs its Checkpointer on rank 0 only, as torch.save habits suggest."""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from worker_exit import exit_without_teardown  # beside this script

import checkfreq as cf
from checkfreq.ranks.compat import default_store

DONE_KEY = "rank0_only/done"


def main() -> None:
    dist.init_process_group("gloo")
    store = default_store()
    if dist.get_rank() == 0:
        start = time.monotonic()
        try:
            cf.Checkpointer(sys.argv[1], model=torch.nn.Linear(2, 2), persist_timeout=3.0)
        except cf.CheckfreqError as e:
            print(f"refused after {time.monotonic() - start:.1f} s: {e}", flush=True)
        finally:
            store.set(DONE_KEY, "1")
    else:
        store.wait([DONE_KEY], timedelta(seconds=150))  # the other rank trains on and never constructs one
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
