"""Export: one checkpoint's state (or one object's) as a plain state dict in a local file,
``.pt``/``.pth`` (``torch.save``) or ``.safetensors``, written atomically (``checkfreq export``).

The checkpoint is found and read through :mod:`checkfreq.tools.catalog`; nothing unpickles.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from checkfreq.errors import CheckfreqError, InvalidArgumentError, UnknownObjectError
from checkfreq.ranks.rebuild import local_view
from checkfreq.run.scaler_state import loadable
from checkfreq.run.state import unflatten
from checkfreq.storage.format import Manifest
from checkfreq.storage.local import fsync_directory
from checkfreq.tools.catalog import CheckpointRef, resolve_checkpoint

log = logging.getLogger("checkfreq.catalog")

EXPORT_SUFFIXES = (".safetensors", ".pt", ".pth")


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export` wrote."""

    source: str
    destination: str
    step: int
    tensors: int
    bytes: int
    dropped: dict[str, int]
    """Non-tensor values left out (a safetensors file holds tensors only), counted per top-level name."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_state(ref: CheckpointRef, only: str | None = None) -> tuple[Manifest, Any]:
    """The verified state of one checkpoint as plain Python: ``{registered_name: state}``, or one
    object's state with ``only``. Tensors are independent CPU copies; NumPy arrays become tensors.
    A checkpoint written by several ranks gives the state one process restores from it: every
    parameter and optimizer tensor whole (put together from the ranks' pieces and shards), and
    saved rank 0's own buffers, values and generators."""
    manifest, stored = ref.read()
    skeleton, tensors = local_view(manifest, stored)
    state = unflatten(skeleton, tensors, allow_pickle=False)
    if only is not None:
        if only not in state:
            raise UnknownObjectError(
                f"checkpoint {ref.name} has no object {only!r}; it holds {', '.join(sorted(state))}"
            )
        state = state[only]
    return manifest, _plain(state)


def _plain(node: Any) -> Any:
    if isinstance(node, torch.Tensor):
        return node.clone()  # a view shares the whole data section; torch.save would write all of it
    if isinstance(node, np.ndarray):
        return torch.from_numpy(node.copy())
    if isinstance(node, dict):  # a GradScaler's scale and growth tracker as the numbers its load_state_dict takes
        return loadable({k: _plain(v) for k, v in node.items()})
    if isinstance(node, list):
        return [_plain(v) for v in node]
    if isinstance(node, tuple):
        return tuple(_plain(v) for v in node)
    return node


def export(
    source: str | os.PathLike[str], destination: str | os.PathLike[str], *, only: str | None = None
) -> ExportResult:
    """Write a checkpoint's state (or one object's, with ``only``) as a plain state dict in a local file.

    ``.pt``/``.pth``: ``torch.save`` of the nested state, loadable with ``torch.load(weights_only=True)``.
    ``.safetensors``: the tensors under their ``/``-joined paths (a module's own keys with ``only``).
    The file appears atomically (written aside, fsynced, renamed), with the permissions of any
    new file (``0o666`` less the umask).
    """
    destination = Path(destination)
    if destination.suffix not in EXPORT_SUFFIXES:
        raise InvalidArgumentError(f"export to {destination.name}: the name must end in {', '.join(EXPORT_SUFFIXES)}")
    ref = resolve_checkpoint(source)
    manifest, state = load_state(ref, only)
    flat, dropped = flatten_tensors(state)
    if not flat:
        raise CheckfreqError(f"nothing to export: {only or 'the checkpoint'} holds no tensors")
    staging = destination.with_name(f".{destination.name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        staging.touch(exist_ok=False)  # created like any new file: the umask applies
        mode = staging.stat().st_mode & 0o777
        if destination.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(flat, str(staging), metadata={"checkfreq_step": str(manifest.step), "checkfreq_only": only or ""})
        else:
            torch.save(state, staging)
            dropped = {}
        os.chmod(staging, mode)  # safetensors replaces the file with a private (0600) one
        _fsync_file(staging)
        os.replace(staging, destination)
        fsync_directory(destination.parent.resolve())
    finally:
        staging.unlink(missing_ok=True)
    log.info("exported %s (%d tensors) to %s", ref.address, len(flat), destination)
    return ExportResult(
        source=ref.address,
        destination=str(destination),
        step=manifest.step,
        tensors=len(flat),
        bytes=destination.stat().st_size,
        dropped=dropped,
    )


def flatten_tensors(state: Any) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """``{path: tensor}`` for every tensor in a nested state (``/``-joined paths), and how many
    non-tensor values each top-level entry holds."""
    tensors: dict[str, torch.Tensor] = {}
    others: dict[str, int] = {}
    for path, value in _leaves(state, ""):
        if isinstance(value, torch.Tensor):
            tensors[path] = value
        else:
            top = path.split("/", 1)[0]
            others[top] = others.get(top, 0) + 1
    return tensors, others


def _leaves(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    items: Iterable[tuple[Any, Any]]
    if isinstance(node, Mapping):
        items = node.items()
    elif isinstance(node, (list, tuple)):
        items = enumerate(node)
    else:
        yield path, node
        return
    for key, value in items:
        yield from _leaves(value, f"{path}/{key}" if path else str(key))


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
