"""Proof that what checkfreq stores once is the same on every rank.

Under data parallelism the parameters and the optimizer state are replicated by construction
(DDP broadcasts rank 0's parameters when it wraps the model and averages the gradients, so every
rank's optimizer takes the same step), and :mod:`checkfreq.ranks.group_cluster` stores them once, split
over the ranks. If they ever differed, storing them once would silently hand every rank a splice of
several ranks' values on restore. So with each checkpoint every rank reports, in the commit report
it sends anyway:

* the **layout** (name, dtype and shape of every replicated tensor);
* **fingerprints** (xxh3-64 of the bytes) of every replicated tensor when the layout is planned,
  and at each later checkpoint of the next window of at most :data:`VERIFY_BYTES` of them, in
  turn, so every byte is checked again from time to time at a bounded cost per checkpoint.

Where the fingerprints are taken: a tensor in host memory is hashed on the training thread at the
snapshot (no copy). A tensor on a device is not: reading it there would block the training thread
until the device caught up (a sync), and at the first checkpoint copy the whole replicated state to
the host through pageable memory. Its pieces are handed to the snapshot instead (:func:`claim`),
which copies them on its side stream with the state, before the fence's event (so in stream order:
what the training stream computed before the snapshot, nothing the next optimizer step changes),
straight into a host buffer of their own (never through the staging buffer, whose layout is the
state's); the writer thread hashes those copies once they have arrived and
completes the claim (:func:`resolve`) before the commit report that carries it. The bytes hashed
are the same on every rank and on either path, so the fingerprints agree where the bytes do. That
host buffer is bounded: when the layout is planned with the state on a device, the first check
covers the head of every replicated tensor, at most :data:`FIRST_DEVICE_BYTES` in all (each tensor's
first elements: the check that catches ranks that started from different weights, or an
optimizer built differently), and the windows that follow cover the rest in turn. Every rank keeps
its replicated state on the same kind of device (as DDP does), so every rank checks the same pieces.

Each rank reports a digest of its claim; rank 0 commits only if every rank reported the same
digest (when they differ, the ranks exchange their claims in full and :func:`disagreement` says
what differs); otherwise every rank raises :class:`~checkfreq.errors.ReplicaMismatchError`
naming the entries and the ranks that disagree, and the last committed checkpoint stays the newest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

import torch
import xxhash

VERIFY_BYTES = 2 << 20
"""Bytes of replicated state each checkpoint after the first verifies (the whole of it when smaller)."""
FIRST_DEVICE_BYTES = 64 << 20
"""Bytes of replicated state on a device the first check of a layout copies to the host and verifies
(the head of every tensor); in host memory the first check verifies every byte."""
SHOWN = 5
"""How many disagreeing entries a message names (the rest are counted)."""

Signature = tuple[tuple[str, str, tuple[int, ...]], ...]
"""(name, dtype, shape) of every replicated tensor, in name order."""


def fingerprint(tensor: torch.Tensor) -> str:
    """xxh3-64 of a host tensor's bytes, in the order of its elements."""
    if tensor.device.type != "cpu":
        raise ValueError(f"a fingerprint is taken of host memory, not of a tensor on {tensor.device}")
    flat = tensor.detach().reshape(-1)
    return xxhash.xxh3_64_hexdigest(flat.contiguous().view(torch.uint8).numpy().data)


def claim(
    layout: Signature, pieces: Mapping[str, torch.Tensor], on_device: Callable[[torch.Tensor], bool]
) -> tuple[ReplicaClaim, dict[str, torch.Tensor]]:
    """This rank's claim of the ``pieces`` it verifies (by label): the host ones fingerprinted now, the
    device ones left out and returned, to be copied by the snapshot and passed to :func:`resolve`."""
    later = {label: piece for label, piece in pieces.items() if on_device(piece)}
    return report(layout, {label: fingerprint(p) for label, p in pieces.items() if label not in later}), later


def resolve(claim: ReplicaClaim, copies: Mapping[str, torch.Tensor]) -> None:
    """Complete ``claim`` with the fingerprints of the host ``copies`` of its device pieces (by label)."""
    claim["fingerprints"].update((label, fingerprint(copy)) for label, copy in copies.items())


class ReplicaClaim(TypedDict):
    """What a rank claims of its replicated state (:func:`report`), as JSON."""

    layout: list[list[Any]]
    """``[name, dtype, shape]`` of every replicated tensor, in name order."""
    fingerprints: dict[str, str]
    """xxh3-64 (hex) of the tensors, or pieces of them, this checkpoint verifies, by their label."""


def report(layout: Signature, fingerprints: Mapping[str, str]) -> ReplicaClaim:
    """What a rank tells the others about its replicated state (JSON-able)."""
    return {"layout": [[n, d, list(s)] for n, d, s in layout], "fingerprints": dict(fingerprints)}


def disagreement(reports: Sequence[Mapping[str, Any]]) -> str | None:
    """``None`` if every rank's :func:`report` is the same, else a message naming entries and ranks."""
    if all(r == reports[0] for r in reports):
        return None
    layouts = [{n: f"{d} {tuple(s)}" for n, d, s in r["layout"]} for r in reports]
    problems = [
        f"{name!r} is " + " but ".join(f"{version} on ranks {ranks}" for version, ranks in versions.items())
        for name, versions in _disagreements(layouts)
    ]
    if not problems:  # the same layout: values differ
        problems = [
            f"{name!r} holds {len(versions)} different values, on ranks " + " and ".join(map(str, versions.values()))
            for name, versions in _disagreements([r["fingerprints"] for r in reports])
        ]
    return (
        f"ranks disagree on state that checkfreq stores once (parameters and optimizer state): {_shown(problems)}. "
        "These must be identical on every rank, as DistributedDataParallel keeps them: wrap the model in "
        "DDP (and register the model itself with the Checkpointer) and give every rank the same optimizer. "
        "No checkpoint is committed while they differ; the last committed one is unchanged."
    )


def sharded_disagreement(per_rank: Sequence[Mapping[str, Mapping[str, Any]]]) -> str | None:
    """A message naming the sharded tensors (DTensors) whose global dtype, shape or recorded layout
    differs between ranks, or ``None`` if none does."""
    specs = [
        {
            n: f"{e['dtype']} {tuple(e['shape'])}" + (f" chunked along dim {e['chunked']}" if "chunked" in e else "")
            for n, e in entries.items()
        }
        for entries in per_rank
    ]
    problems = [
        f"{name!r} is " + " but ".join(f"{version} on ranks {ranks}" for version, ranks in versions.items())
        for name, versions in _disagreements(specs)
    ]
    if not problems:
        return None
    return (
        f"ranks disagree on the global dtype, shape or layout of sharded tensors (DTensors): {_shown(problems)}. "
        "Every rank must register the same sharded model and optimizer. No checkpoint is committed while they differ."
    )


def _shown(problems: Sequence[str]) -> str:
    """The first :data:`SHOWN` problems, and how many more there are."""
    return "; ".join(problems[:SHOWN]) + (f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else "")


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
