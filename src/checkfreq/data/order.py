"""What a data order is a function of: seeds mixed from (seed, epoch, index) with splitmix64, the
job's ranks, and the checks of the values a sampler or loader is built from."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from checkfreq.errors import InvalidArgumentError

_MASK64 = (1 << 64) - 1
ORDER_DOMAIN = 0
_SAMPLE_DOMAIN = 1
FINGERPRINT_KEYS = ("dataset_length", "seed", "shuffle")
RESERVED_LOADER_ARGS = frozenset({"sampler", "batch_sampler", "generator", "in_order"})


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix(*words: int) -> int:
    """A 63-bit seed that depends on every word (well spread, cheap, stable across versions)."""
    h = 0
    for word in words:
        h = splitmix64(h ^ (word & _MASK64))
    return h >> 1


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed the generators are set to before ``dataset[index]`` is loaded in ``epoch``."""
    return mix(_SAMPLE_DOMAIN, seed, epoch, index)


def job_topology() -> tuple[int, int] | None:
    """(rank, world size) of the torch.distributed job, or ``None`` when no process group is initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None


def check_topology(rank: int, world_size: int) -> tuple[int, int]:
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidArgumentError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size


def plain(value: Any) -> Any:
    """A saved scalar as a Python value (a state may come back with 0-d tensors)."""
    return value.item() if isinstance(value, torch.Tensor) else value


def check_positive(name: str, value: Any) -> None:
    """:class:`InvalidArgumentError` unless ``value`` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
