"""Proof that what checkfreq stores once is the same on every rank.

Under data parallelism the parameters and the optimizer state are replicated by construction
(DDP broadcasts rank 0's parameters when it wraps the model and averages the gradients, so every
rank's optimizer takes the same step), and :mod:`checkfreq.distributed` stores them once, split
over the ranks. If they ever differ, storing them once would silently hand every rank a splice of
several ranks' values on restore. So the ranks compare, on the training thread, at each checkpoint:

* the **layout** (name, dtype and shape of every replicated tensor), always;
* **fingerprints** (xxh3-64 of the bytes) of every replicated tensor when the layout is planned,
  and of one of :data:`VERIFY_SLICES` rotating slices of the bytes at each later checkpoint, so
  every byte is checked again every :data:`VERIFY_SLICES` checkpoints at a small cost.

Each rank sends one short digest of both; only when the digests differ do the ranks exchange the
details, and then every rank raises :class:`~checkfreq.errors.ReplicaMismatchError` naming the
entries and the ranks that disagree. No checkpoint is started, so the last good one stays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import xxhash

from checkfreq.errors import ReplicaMismatchError

VERIFY_SLICES = 16
"""The replicated bytes are cut into this many slices; each checkpoint after the first verifies one."""
SHOWN = 5
"""How many disagreeing entries an error message names (the rest are counted)."""

Layout = tuple[tuple[str, str, tuple[int, ...]], ...]
"""(name, dtype, shape) of every replicated tensor, in name order."""


def fingerprint(tensor: torch.Tensor) -> str:
    """xxh3-64 of a tensor's bytes (copied to host memory first if it lives on a device)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return xxhash.xxh3_64_hexdigest(memoryview(flat.contiguous().view(torch.uint8).numpy()))


def agree(layout: Layout, fingerprints: Mapping[str, str], gather: Any) -> None:
    """Raise :class:`ReplicaMismatchError` on every rank unless all ranks hold the same layout and values.

    ``gather`` is an all-gather of a JSON-able value over the ranks (in rank order).
    """
    mine = {"layout": _digest(repr(layout)), "values": _digest(repr(sorted(fingerprints.items())))}
    if all(digest == mine for digest in gather(mine)):
        return
    details = gather({"layout": [[n, d, list(s)] for n, d, s in layout], "values": dict(fingerprints)})
    raise ReplicaMismatchError(describe(details))


def describe(details: Sequence[Mapping[str, Any]]) -> str:
    """The message for ranks that disagree: which entries, and which ranks hold which version."""
    layouts = [{n: f"{d} {tuple(s)}" for n, d, s in rank["layout"]} for rank in details]
    problems = [
        f"{name!r} is " + " but ".join(f"{version} on ranks {ranks}" for version, ranks in versions.items())
        for name, versions in _disagreements(layouts)
    ]
    if not problems:  # the same layout: values differ
        problems = [
            f"{name!r} holds {len(versions)} different values, on ranks " + " and ".join(map(str, versions.values()))
            for name, versions in _disagreements([rank["values"] for rank in details])
        ]
    shown = "; ".join(problems[:SHOWN]) + (f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else "")
    return (
        f"ranks disagree on state that checkfreq stores once (parameters and optimizer state): {shown}. "
        "These must be identical on every rank, as DistributedDataParallel keeps them: wrap the model in "
        "DDP (and register the model itself with the Checkpointer) and give every rank the same optimizer. "
        "Nothing was checkpointed; the last checkpoint is unchanged."
    )


def _disagreements(per_rank: Sequence[Mapping[str, str]]) -> list[tuple[str, dict[str, list[int]]]]:
    """(name, {version: ranks holding it}) for every name whose version is not the same on all ranks."""
    found = []
    for name in sorted(set().union(*per_rank)):
        versions: dict[str, list[int]] = {}
        for rank, entries in enumerate(per_rank):
            versions.setdefault(entries.get(name, "absent"), []).append(rank)
        if len(versions) > 1:
            found.append((name, versions))
    return found


def _digest(text: str) -> str:
    return xxhash.xxh3_64_hexdigest(text.encode())
