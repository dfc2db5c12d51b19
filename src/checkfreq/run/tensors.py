"""What a tensor is to checkfreq: a DTensor or a plain one, and where its values live."""

from __future__ import annotations

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
