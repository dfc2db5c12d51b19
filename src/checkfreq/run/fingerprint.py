"""A cheap fingerprint of registered state: did it change since a checkpoint took it?

Taken with every snapshot and compared later (before the next batch, at ``save()``), it tells a
checkpoint that no longer holds the state of its step: an epoch-level scheduler stepped, an
evaluation drew random numbers, a value set after the checkpoint. The non-tensor part of each
object's state and its small CPU tensors (generator states, counters) are hashed; a large tensor
is represented by its version counter, which every in-place change (an optimizer step, ``copy_``
under ``no_grad``) moves, so nothing large is read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
import xxhash

from checkfreq.run.state import flatten

SMALL_TENSOR_BYTES = 64 * 1024
"""CPU tensors up to this size are hashed byte for byte; larger ones by their version counter."""

Fingerprint = dict[str, str]
"""One digest per registered name."""


def fingerprint(state: Mapping[str, Any], *, allow_pickle: bool) -> Fingerprint:
    """The digest of each entry of ``{name: state_dict or value}``."""
    return {name: _digest(name, value, allow_pickle) for name, value in state.items()}


def changed(before: Fingerprint, now: Fingerprint) -> list[str]:
    """The names whose digest differs (or that one of the two lacks), sorted."""
    return sorted(name for name in before.keys() | now.keys() if before.get(name) != now.get(name))


def _digest(name: str, value: Any, allow_pickle: bool) -> str:
    skeleton, tensors = flatten({name: value}, allow_pickle=allow_pickle)
    h = xxhash.xxh3_64(json.dumps(skeleton, sort_keys=True, default=repr).encode())
    for key in sorted(tensors):
        tensor = tensors[key]
        h.update(f"{key}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        if tensor.device.type == "cpu" and tensor.nbytes <= SMALL_TENSOR_BYTES and _plain(tensor):
            h.update(tensor.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"v{getattr(tensor, '_version', 0)}".encode())
    return h.hexdigest()


def _plain(tensor: torch.Tensor) -> bool:
    """A dense tensor whose bytes can be read as they are (not a DTensor, sparse or quantized one)."""
    return type(tensor) is torch.Tensor and tensor.layout == torch.strided and not tensor.is_quantized


__all__ = ["SMALL_TENSOR_BYTES", "Fingerprint", "changed", "fingerprint"]
