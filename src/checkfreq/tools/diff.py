"""Two checkpoints compared tensor by tensor: which differ, by how much (``checkfreq diff``)."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from checkfreq.errors import (
    CorruptCheckpointError,
)
from checkfreq.storage.format import (
    Manifest,
)
from checkfreq.tools.catalog import CheckpointRef, resolve_checkpoint


@dataclass(frozen=True)
class TensorDiff:
    """How one tensor differs between checkpoints A and B."""

    name: str
    status: str
    """``equal``, ``differs``, ``only_a``, ``only_b`` or ``mismatch`` (shape or dtype)."""
    detail: str | None
    changed: int
    """Elements that differ (0 unless ``differs``)."""
    numel: int
    max_abs: float | None
    rel_l2: float | None
    """‖A − B‖₂ / ‖A‖₂ (inf when A is all zeros and B is not; null in JSON)."""

    def to_dict(self) -> dict[str, Any]:
        return {k: _json_safe(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class CheckpointDiff:
    """Every tensor of two checkpoints compared by name."""

    a: str
    b: str
    step_a: int
    step_b: int
    tensors: list[TensorDiff]

    @property
    def identical(self) -> bool:
        return all(t.status == "equal" for t in self.tensors)

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a, "b": self.b, "step_a": self.step_a, "step_b": self.step_b,
            "identical": self.identical, "tensors": [t.to_dict() for t in self.tensors],
        }


def diff(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> CheckpointDiff:
    """Compare two checkpoints (both verified against their checksums) tensor by tensor."""
    ref_a, ref_b = resolve_checkpoint(a), resolve_checkpoint(b)
    manifest_a, tensors_a = _read_side("A", ref_a)
    manifest_b, tensors_b = _read_side("B", ref_b)
    rows = [
        _compare(name, tensors_a.get(name), tensors_b.get(name)) for name in sorted(tensors_a.keys() | tensors_b.keys())
    ]
    order = {"mismatch": 0, "only_a": 1, "only_b": 1, "differs": 2, "equal": 3}
    rows.sort(key=lambda r: (order[r.status], -(r.rel_l2 or 0.0), r.name))
    return CheckpointDiff(ref_a.address, ref_b.address, manifest_a.step, manifest_b.step, rows)


def _read_side(side: str, ref: CheckpointRef) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """``ref.read()``, its corruption errors naming which side of the diff, and where, failed."""
    try:
        return ref.read()
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"checkpoint {side} ({ref.address}): {e}") from e


def _compare(name: str, x: torch.Tensor | None, y: torch.Tensor | None) -> TensorDiff:
    if x is None or y is None:
        present = x if x is not None else y
        return TensorDiff(name, "only_a" if y is None else "only_b", None, 0, present.numel(), None, None)  # type: ignore[union-attr]
    if x.shape != y.shape or x.dtype != y.dtype:
        detail = f"A {tuple(x.shape)} {x.dtype}, B {tuple(y.shape)} {y.dtype}"
        return TensorDiff(name, "mismatch", detail, 0, x.numel(), None, None)
    xd, yd = x.to(torch.float64), y.to(torch.float64)
    unequal = (xd != yd) & ~(torch.isnan(xd) & torch.isnan(yd))
    changed = int(unequal.sum())
    if changed == 0:
        return TensorDiff(name, "equal", None, 0, x.numel(), 0.0, 0.0)
    delta = (xd - yd).abs()
    max_abs = float(delta.max())
    norm_a, norm_d = float(torch.linalg.vector_norm(xd)), float(torch.linalg.vector_norm(xd - yd))
    rel = norm_d / norm_a if norm_a > 0 else math.inf
    return TensorDiff(name, "differs", None, changed, x.numel(), max_abs, rel)


def _json_safe(value: Any) -> Any:
    """``value``, but a float that JSON cannot hold (inf, nan) as None."""
    return None if isinstance(value, float) and not math.isfinite(value) else value
