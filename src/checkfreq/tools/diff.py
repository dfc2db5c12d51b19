"""Two checkpoints compared: which tensors differ and by how much, and which other values
(numbers, strings, ... of the registered state) differ (``checkfreq diff``)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from checkfreq.errors import (
    CorruptCheckpointError,
)
from checkfreq.ranks.rebuild import local_view
from checkfreq.ranks.shares import PRIVATE, private_name
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
class ValueDiff:
    """How one value of the state that is not a tensor (a registered plain value such as a
    learning rate, a loader's position, Python's random state, an optimizer's hyperparameter)
    differs between checkpoints A and B."""

    name: str
    status: str
    """``equal``, ``differs``, ``only_a`` or ``only_b``."""
    a: Any
    b: Any
    """The values (None where absent); a list of numbers is one value."""

    def to_dict(self) -> dict[str, Any]:
        return {k: _json_safe(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class CheckpointDiff:
    """Every tensor and every other value of two checkpoints compared by name."""

    a: str
    b: str
    step_a: int
    step_b: int
    tensors: list[TensorDiff]
    values: list[ValueDiff] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return all(t.status == "equal" for t in self.tensors) and all(v.status == "equal" for v in self.values)

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "step_a": self.step_a,
            "step_b": self.step_b,
            "identical": self.identical,
            "tensors": [t.to_dict() for t in self.tensors],
            "values": [v.to_dict() for v in self.values],
        }


def diff(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> CheckpointDiff:
    """Compare two checkpoints (both verified against their checksums): every tensor by name, and
    every other value of the state (but the reserved ``checkfreq`` entry: what the run measured)."""
    ref_a, ref_b = resolve_checkpoint(a), resolve_checkpoint(b)
    manifest_a, tensors_a = _read_side("A", ref_a)
    manifest_b, tensors_b = _read_side("B", ref_b)
    tensors_a, tensors_b = _tensors("A", ref_a, manifest_a, tensors_a), _tensors("B", ref_b, manifest_b, tensors_b)
    rows = [
        _compare(name, tensors_a.get(name), tensors_b.get(name)) for name in sorted(tensors_a.keys() | tensors_b.keys())
    ]
    order = {"mismatch": 0, "only_a": 1, "only_b": 1, "differs": 2, "equal": 3}
    rows.sort(key=lambda r: (order[r.status], -(r.rel_l2 or 0.0), r.name))
    values_a, values_b = _values(manifest_a), _values(manifest_b)
    values = [
        _compare_value(name, values_a.get(name, _ABSENT), values_b.get(name, _ABSENT))
        for name in sorted(values_a.keys() | values_b.keys())
    ]
    values.sort(key=lambda v: (order[v.status], v.name))
    return CheckpointDiff(ref_a.address, ref_b.address, manifest_a.step, manifest_b.step, rows, values)


def _read_side(side: str, ref: CheckpointRef) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """``ref.read()``, its corruption errors naming which side of the diff, and where, failed."""
    try:
        return ref.read()
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"checkpoint {side} ({ref.address}): {e}") from e


def _tensors(
    side: str, ref: CheckpointRef, manifest: Manifest, stored: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint by name, whatever the world size that wrote it: a parameter or
    an optimizer tensor whole (put together from the ranks' pieces and shards, as a restore in one
    process gets it), a private tensor (a buffer, a random state) once per rank, named
    ``name@rankNNNNN`` when several ranks wrote it, as :func:`_values` names the values."""
    meta = manifest.distributed
    if meta is None:
        return stored
    try:
        _, whole = local_view(manifest, stored)
        entries = meta["tensors"]
        tensors = {name: t for name, t in whole.items() if entries[name]["kind"] != PRIVATE}
        for name, entry in entries.items():
            if entry["kind"] == PRIVATE:
                for rank, part in enumerate(entry["parts"]):
                    if part is not None:
                        tensors[name if manifest.world_size == 1 else private_name(name, rank)] = stored[part]
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"checkpoint {side} ({ref.address}): {e}") from e
    except (KeyError, TypeError, IndexError) as e:
        raise CorruptCheckpointError(
            f"checkpoint {side} ({ref.address}): manifest's distributed index is malformed: {type(e).__name__}: {e}"
        ) from None
    return tensors


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


_ABSENT = object()
_SCALARS = (bool, int, float, str, type(None))
RUN_ENTRY = "checkfreq"
"""The reserved entry holding what the run measured (timings, the policy's state): not compared."""


def _values(manifest: Manifest) -> dict[str, Any]:
    """Every value of the state that is not a tensor, by path; in a checkpoint of several ranks,
    each rank's (its skeleton is its own) named as its private tensors are, ``path@rankNNNNN``."""
    ranks = (manifest.distributed or {}).get("ranks") if manifest.world_size > 1 else None
    skeletons = [(manifest.state, None)] if not ranks else [(s, r) for r, s in enumerate(ranks)]
    found: dict[str, Any] = {}
    for skeleton, rank in skeletons:
        for name, node in (skeleton or {}).items():
            if name == RUN_ENTRY:
                continue
            for path, value in _leaves(node, name):
                found[path if rank is None else private_name(path, rank)] = value
    return found


def _leaves(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    """The non-tensor leaves of a skeleton node (docs: ``checkfreq.run.state``); a list or tuple of
    plain scalars (Python's random state, Adam's betas) is one leaf."""
    if isinstance(node, dict) and len(node) == 1:
        ((marker, inner),) = node.items()
        if marker in ("__tensor__", "__ndarray__"):
            return  # compared as a tensor
        if marker == "__tuple__":
            node = inner
        elif marker == "__items__":
            node = {str(k): v for k, v in inner}
    if isinstance(node, list) and node and not all(isinstance(v, _SCALARS) for v in node):
        for i, value in enumerate(node):
            yield from _leaves(value, f"{path}/{i}")
    elif isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaves(value, f"{path}/{key}")
    else:
        yield path, node


def _compare_value(name: str, x: Any, y: Any) -> ValueDiff:
    if x is _ABSENT or y is _ABSENT:
        return ValueDiff(
            name, "only_b" if x is _ABSENT else "only_a", None if x is _ABSENT else x, None if y is _ABSENT else y
        )
    return ValueDiff(name, "equal" if _same(x, y) else "differs", x, y)


def _same(x: Any, y: Any) -> bool:
    """Equal in type and value (NaN equals NaN; 1 is not 1.0 or True)."""
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y, strict=True))
    if type(x) is not type(y):
        return False
    if isinstance(x, float) and math.isnan(x):
        return math.isnan(y)
    return bool(x == y)


def _json_safe(value: Any) -> Any:
    """``value``, but a float that JSON cannot hold (inf, nan) as None, in a list too."""
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value
