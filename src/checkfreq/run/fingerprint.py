"""A cheap fingerprint of registered state: did it change since a checkpoint took it?

Taken with every checkpoint and compared later (at ``save()``, at the consistent point after a
``save()``), it tells a checkpoint that no longer holds the state of its step: an epoch-level
scheduler stepped, an evaluation drew random numbers, a value set after the checkpoint. The non-tensor part of each
object's state and its small CPU tensors (generator states, counters) are hashed; a large tensor
is represented by its version counter, which every in-place change (an optimizer step, ``copy_``
under ``no_grad``) moves, so nothing large is read.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import xxhash

SMALL_TENSOR_BYTES = 64 * 1024
"""CPU tensors up to this size are hashed byte for byte; larger ones by their version counter."""

MAX_DEPTH = 64
"""Containers nested deeper are represented by their ``repr``."""

Fingerprint = dict[str, str]
"""One digest per registered name."""

_PLAIN = (int, float, str, bool, type(None))


def fingerprint(state: Mapping[str, Any]) -> Fingerprint:
    """The digest of each entry of ``{name: state_dict or value}``."""
    digests = {}
    for name, value in state.items():
        h = xxhash.xxh3_64()
        _feed(h, value, 0)
        digests[name] = h.hexdigest()
    return digests


def changed(before: Fingerprint, now: Fingerprint) -> list[str]:
    """The names whose digest differs (or that one of the two lacks), sorted."""
    return sorted(name for name in before.keys() | now.keys() if before.get(name) != now.get(name))


def _feed(h: Any, value: Any, depth: int) -> None:
    if isinstance(value, torch.Tensor):
        h.update(f"T{tuple(value.shape)}{value.dtype}".encode())
        if value.device.type == "cpu" and value.nbytes <= SMALL_TENSOR_BYTES and _plain(value):
            h.update(value.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"v{getattr(value, '_version', 0)}".encode())
    elif isinstance(value, np.ndarray):
        h.update(f"N{value.shape}{value.dtype}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict) and depth < MAX_DEPTH:
        h.update(b"{")
        for key, item in value.items():
            h.update(repr(key).encode())
            _feed(h, item, depth + 1)
        h.update(b"}")
    elif isinstance(value, (list, tuple)) and depth < MAX_DEPTH and not all(isinstance(v, _PLAIN) for v in value):
        h.update(b"[")
        for item in value:
            _feed(h, item, depth + 1)
        h.update(b"]")
    elif isinstance(value, (list, tuple)) and depth < MAX_DEPTH:  # plain values only: pickled at C speed
        h.update(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    else:
        h.update(repr(value).encode())


def _plain(tensor: torch.Tensor) -> bool:
    """A dense tensor whose bytes can be read as they are (not a DTensor, sparse or quantized one)."""
    return type(tensor) is torch.Tensor and tensor.layout == torch.strided and not tensor.is_quantized


__all__ = ["SMALL_TENSOR_BYTES", "Fingerprint", "changed", "fingerprint"]
