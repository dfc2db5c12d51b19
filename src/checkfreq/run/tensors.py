"""What a tensor is to checkfreq: a DTensor or a plain one, and where its values live."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch


def is_dtensor(tensor: torch.Tensor) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (without importing it when unused)."""
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "to_local")


def storage_ptr(tensor: torch.Tensor) -> int:
    """The address of the values a tensor's owner updates (a DTensor's local shard)."""
    return local_part(tensor).data_ptr()


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    return cast(Any, tensor).to_local() if is_dtensor(tensor) else tensor


def any_cuda(tensors: Iterable[torch.Tensor]) -> bool:
    """True if any of ``tensors`` lives on a CUDA device (its copies to and from the host go over PCIe)."""
    return any(t.is_cuda for t in tensors)


def objects_on_cuda(objects: Iterable[object]) -> bool:
    """True if a registered module or optimizer holds CUDA parameters: a restore lands on the GPU."""
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            params: Iterable[torch.Tensor] = obj.parameters()
        elif isinstance(obj, torch.optim.Optimizer):
            params = (p for group in obj.param_groups for p in group["params"])
        else:
            continue
        if any_cuda(params):
            return True
    return False
