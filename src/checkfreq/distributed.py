"""Checkpointing under ``torch.distributed``: every rank writes its share, rank 0 commits.

A :class:`Cluster` is attached by the Checkpointer when a default process group is initialised
(``torchrun``); users write no extra code. It creates two dedicated gloo groups and never uses
the training process group after that:

* the **control** group, used only from the training thread: agreeing on *when* to checkpoint
  (for policies whose answer may differ between ranks) and on *which* checkpoint to restore;
* the **commit** group, used only from each rank's background writer: after a rank's data file
  is fsynced it sends a small JSON report; rank 0 writes ``manifest.json`` and renames the
  staging directory only if every rank reported a durable file and the same replicated state
  (:mod:`checkfreq.replicas`), then tells everyone the outcome.

A rank that dies before reporting leaves the staging directory uncommitted (never listed, never
restored, removed by rank 0 at the next start). See docs/distributed.md.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from checkfreq import replicas
from checkfreq.compat import default_store
from checkfreq.distributed_plan import (
    PRIVATE,
    REPLICATED,
    SHARDED,
    Piece,
    dtype_entry,
    kind_of,
    local_box,
    local_view,
    partition,
    piece_view,
    private_name,
    restore_targets,
    stream_range,
)
from checkfreq.errors import CheckfreqError, CorruptCheckpointError, NoValidCheckpointError, PersistError, ReplicaMismatchError
from checkfreq.format import Manifest, encode_header, tensor_entries, write_data_file, write_manifest
from checkfreq.groups import new_gloo_group
from checkfreq.policies import DecisionContext, Every, Policy
from checkfreq.snapshot import PendingSnapshot
from checkfreq.state import flatten
from checkfreq.storage.local import LocalStore, checkpoint_name

log = logging.getLogger("checkfreq.distributed")

Found = tuple[Manifest, dict[str, torch.Tensor], Path, list[tuple[str, str]]]
"""A checkpoint read for restore: manifest, stored arrays, its directory, the ones skipped before it."""


def attach(store: LocalStore, timeout: float) -> Cluster | None:
    """A :class:`Cluster` if a default process group is initialised, else ``None`` (one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return Cluster(store, timeout)


JOIN_TIMEOUT = 600.0
"""At most this many seconds for every rank to construct its Checkpointer (``persist_timeout`` if shorter)."""
_JOIN_WARNING_S = 30.0
_joins = itertools.count()


def wait_for_every_rank(world_size: int, timeout: float) -> None:
    """Return once every rank has constructed its Checkpointer; raise after ``timeout`` seconds.

    The habit ``torch.save`` teaches (checkpoint on rank 0 only) would otherwise hang in the
    collective creation of the Cluster's groups, with no word of why.
    """
    store = default_store()
    key = f"checkfreq/join/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_joins)}"
    arrived = store.add(key, 1)
    start = warned = time.monotonic()
    while arrived < world_size:
        now = time.monotonic()
        if now - start > timeout:
            raise CheckfreqError(
                f"only {arrived} of {world_size} ranks constructed a Checkpointer within {timeout:.0f} s: every "
                "rank must construct it at the same point (not only rank 0), and call step() on every rank"
            )
        if now - warned > _JOIN_WARNING_S:
            log.warning("waiting for every rank to construct its Checkpointer (%d of %d so far)", arrived, world_size)
            warned = now
        time.sleep(0.02)
        arrived = store.add(key, 0)


def rank_file(rank: int) -> str:
    """The data file rank ``rank`` writes."""
    return f"rank{rank:05d}.safetensors"


class Cluster:
    """This rank's part in checkpointing: its share of the state, the commit protocol, restore.

    Created collectively (every rank must construct its Checkpointer at the same point). Rank 0
    takes the directory lock and clears leftovers of uncommitted checkpoints before any rank
    goes on.
    """

    def __init__(self, store: LocalStore, timeout: float) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        wait_for_every_rank(self.world_size, min(timeout, JOIN_TIMEOUT))
        self._store = store
        wait = timedelta(seconds=timeout)
        self._control = new_gloo_group("control", wait)
        self._commit = new_gloo_group("commit", wait)
        self._plan: Plan | None = None
        self._decider: AgreedPolicy | None = None
        message: dict[str, Any] | None = {"error": "rank 0 failed while opening the directory"}
        if self.rank == 0:
            try:
                store.lock()
                store.remove_staging()
                message = {"token": uuid.uuid4().hex[:12]}
            except (OSError, CheckfreqError) as e:
                message = {"error": str(e)}
                raise
            finally:
                message = broadcast_json(message, self._control)
        else:
            message = broadcast_json(None, self._control)
        if "error" in message:
            raise CheckfreqError(f"rank 0 could not open the checkpoint directory: {message['error']}")
        self._token = message["token"]

    @property
    def control_group(self) -> Any:
        """The gloo group for small agreements between ranks (decisions, restore choices)."""
        return self._control

    # -------------------------------------------------------------- training thread

    def decider(self, policy: Policy) -> Callable[[DecisionContext], bool]:
        """``policy.should_save``, agreed by all ranks (a step-count policy needs no messages)."""
        if isinstance(policy, Every) and policy.n is not None:
            return policy.should_save
        self._decider = AgreedPolicy(policy, self._control)
        return self._decider.should_save

    def select(
        self, tensors: Mapping[str, torch.Tensor], owned: set[str], replicated: set[str]
    ) -> tuple[dict[str, torch.Tensor], set[str], dict[str, Any]]:
        """This rank's share of ``tensors``: (arrays to write, which of them are fenced, their index).

        ``replicated`` names the tensors that are the same on every rank (parameters and optimizer
        state): they are split over the ranks, and fingerprinted for rank 0 to verify at the commit
        (:mod:`checkfreq.replicas`); every other tensor is written by each rank for itself.
        """
        names = sorted(n for n, t in tensors.items() if kind_of(n, t, replicated) == REPLICATED)
        layout = tuple((n, str(tensors[n].dtype), tuple(tensors[n].shape)) for n in names)
        if self._plan is None or self._plan.layout != layout:
            self._plan = Plan.of(layout, [(n, tensors[n].numel(), tensors[n].element_size()) for n in names], self)
            checked = self._plan.verify_all()
        else:
            checked = self._plan.verify_next()
        plan = self._plan
        claim = replicas.report(layout, {_label(p): replicas.fingerprint(piece_view(tensors[p.name], p)) for p in checked})
        arrays: dict[str, torch.Tensor] = {}
        index: dict[str, Any] = {}
        for piece in plan.pieces:
            tensor = tensors[piece.name]
            arrays[piece.stored_name] = piece_view(tensor, piece)
            index[piece.name] = _entry(tensor, REPLICATED, [piece.stored_name, piece.begin, piece.end])
        for name, tensor in tensors.items():
            kind = kind_of(name, tensor, replicated)
            if kind == REPLICATED:
                continue
            stored = private_name(name, self.rank)
            if kind == SHARDED:
                arrays[stored] = tensor.to_local()
                offset, _ = local_box(tensor)
                index[name] = _entry(tensor, SHARDED, [stored, list(offset)])
            else:
                arrays[stored] = tensor
                index[name] = _entry(tensor, PRIVATE, stored)
        fenced = {stored for stored, name in _origins(index) if name in owned}
        return arrays, fenced, {"tensors": index, "replicas": claim}

    def find(self, find_local: Callable[[], Found | None], read: Callable[[Path], tuple[Manifest, dict[str, torch.Tensor]]]) -> Found | None:
        """The checkpoint every rank restores: rank 0 picks the newest valid one, all read it."""
        found: Found | None = None
        choice: dict[str, Any] = {"error": "rank 0 failed while looking for a checkpoint"}
        if self.rank == 0:
            try:
                found = find_local()
                choice = {"name": None if found is None else found[2].name}
            except NoValidCheckpointError as e:
                choice = {"error": str(e)}
                raise
            finally:
                choice = broadcast_json(choice, self._control)
        else:
            choice = broadcast_json(None, self._control)
        if "error" in choice:
            raise NoValidCheckpointError(choice["error"])
        if choice["name"] is None:
            return None
        problem = None
        if found is None:
            path = self._store.root / choice["name"]
            try:
                manifest, tensors = read(path)
                found = (manifest, tensors, path, [])
            except CorruptCheckpointError as e:
                problem = f"rank {self.rank}: {e}"
        problems = [p for p in all_gather_json(problem, self._control) if p]
        if problems:
            raise CorruptCheckpointError(f"not every rank can read {choice['name']}: {'; '.join(problems)}")
        return found

    def view(self, manifest: Manifest, stored: Mapping[str, torch.Tensor], objects: Mapping[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
        """This rank's skeleton and tensors, DTensors cut to the placement of the live ones."""
        _, live = flatten({n: o.state_dict() for n, o in objects.items()}, allow_pickle=True)
        optimizers = {n: o for n, o in objects.items() if isinstance(o, torch.optim.Optimizer)}
        saved = manifest.distributed.get("tensors") if manifest.distributed else None
        names = list(saved) if isinstance(saved, dict) else list(stored)
        return local_view(manifest, stored, self.rank, restore_targets(live, optimizers, names))

    def close(self) -> None:
        """Finish the decision exchange in flight (every rank has started the same number)."""
        if self._decider is not None:
            self._decider.close()

    # -------------------------------------------------------------- writer thread

    def persist(
        self, pending: PendingSnapshot, share: dict[str, Any], skeleton: Any, step: int, epoch: int | None, versions: dict[str, str]
    ) -> tuple[Path | None, int]:
        """Write this rank's file, then commit with the others; returns (checkpoint on rank 0, bytes written)."""
        staging = self._store.root / f"{checkpoint_name(step)}.tmp-{self._token}"
        name = rank_file(self.rank)
        report: dict[str, Any] = {"rank": self.rank}
        failure: BaseException | None = None
        size = 0
        try:
            pending.finish_copy()
            staging.mkdir(exist_ok=True)
            size, digest = write_data_file(staging / name, encode_header(pending.layout), pending.buffer)
            report.update(ok=True, file=name, size=size, xxh3_64=digest, index=tensor_entries(pending.layout, name), state=skeleton, **share)
        except Exception as e:  # noqa: BLE001 - reported to every rank, then raised here
            failure = e
            report.update(ok=False, error=f"rank {self.rank}: {type(e).__name__}: {e}")
        finally:
            pending.copied.set()
        reports = all_gather_json(report, self._commit)
        outcome = self._commit_all(reports, staging, step, epoch, versions) if self.rank == 0 else None
        outcome = broadcast_json(outcome, self._commit)
        if outcome["error"] is not None:
            error = ReplicaMismatchError if outcome.get("replicas") else PersistError
            raise error(f"checkpoint {step} not committed: {outcome['error']}") from failure
        return (Path(outcome["path"]) if self.rank == 0 else None), size

    def _commit_all(self, reports: list[dict[str, Any]], staging: Path, step: int, epoch: int | None, versions: dict[str, str]) -> dict[str, Any]:
        """Rank 0: write the manifest and publish the checkpoint if every rank's file is durable."""
        try:
            errors = [r["error"] for r in reports if not r.get("ok")]
            if errors:
                raise PersistError("; ".join(errors))
            problem = replicas.disagreement([r["replicas"] for r in reports])
            if problem is not None:
                raise ReplicaMismatchError(problem)
            write_manifest(staging, _merge(reports, step, epoch, versions))
            return {"error": None, "path": str(self._store.commit(staging, step))}
        except Exception as e:  # noqa: BLE001 - every rank must hear the outcome
            shutil.rmtree(staging, ignore_errors=True)
            log.warning("checkpoint %d not committed: %s", step, e)
            return {"error": str(e), "replicas": isinstance(e, ReplicaMismatchError)}


@dataclass
class Plan:
    """The replicated layout this rank plans for: its share, and what each checkpoint verifies."""

    layout: replicas.Layout
    sizes: list[tuple[str, int, int]]
    """(name, numel, itemsize) of every replicated tensor."""
    pieces: list[Piece]
    """This rank's share of the replicated bytes."""
    checks: int = 0

    @classmethod
    def of(cls, layout: replicas.Layout, sizes: list[tuple[str, int, int]], cluster: Cluster) -> Plan:
        return cls(layout, sizes, partition(sizes, cluster.world_size)[cluster.rank])

    def verify_all(self) -> list[Piece]:
        """Every tensor, whole: the layout was just planned."""
        return [Piece(name, 0, numel, True) for name, numel, _ in self.sizes]

    def verify_next(self) -> list[Piece]:
        """The next window of at most :data:`~checkfreq.replicas.VERIFY_BYTES` of the bytes, in turn."""
        self.checks += 1
        total = sum(numel * itemsize for _, numel, itemsize in self.sizes)
        windows = max(1, -(-total // replicas.VERIFY_BYTES))
        k = self.checks % windows
        return stream_range(self.sizes, k * total // windows, (k + 1) * total // windows)


class AgreedPolicy:
    """Wraps a policy whose answer may differ between ranks; ranks act on the agreed answer.

    At each step every rank asks its policy and starts a non-blocking MAX all-reduce of the answer
    on the control group; the result is collected at the next step, which checkpoints if any rank
    wanted to. Waiting costs nothing in steady state (the exchange had a whole step to finish), at
    the price of checkpointing one step after the policy asked.
    """

    def __init__(self, policy: Policy, group: Any) -> None:
        self.policy = policy
        self._group = group
        self._vote = torch.zeros(1, dtype=torch.int64)
        self._work: Any = None

    def should_save(self, ctx: DecisionContext) -> bool:
        agreed = self._collect()
        want = not agreed and self.policy.should_save(ctx)
        self._vote = torch.tensor([int(want)], dtype=torch.int64)
        self._work = dist.all_reduce(self._vote, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        return agreed

    def _collect(self) -> bool:
        if self._work is None:
            return False
        self._work.wait()
        self._work = None
        return bool(self._vote.item())

    def close(self) -> None:
        self._collect()


def _label(piece: Piece) -> str:
    """A piece as people read it: the tensor's name, with the range of its flattened elements if partial."""
    return piece.name if piece.whole else f"{piece.name}[{piece.begin}:{piece.end}]"


def _entry(tensor: torch.Tensor, kind: str, part: Any) -> dict[str, Any]:
    return {"dtype": dtype_entry(tensor), "shape": list(tensor.shape), "kind": kind, "parts": [part]}


def _origins(index: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(stored array, tensor it belongs to) for one rank's index."""
    pairs = []
    for name, entry in index.items():
        for part in entry["parts"]:
            pairs.append((part if isinstance(part, str) else part[0], name))
    return pairs


def _merge(reports: list[dict[str, Any]], step: int, epoch: int | None, versions: dict[str, str]) -> Manifest:
    """One manifest from every rank's report: files, array index, per-rank skeletons, tensor parts."""
    world = len(reports)
    files, index, merged = {}, {}, {}
    for report in sorted(reports, key=lambda r: r["rank"]):
        rank = report["rank"]
        files[report["file"]] = {"size": report["size"], "xxh3_64": report["xxh3_64"]}
        index.update(report["index"])
        for name, entry in report["tensors"].items():
            into = merged.setdefault(name, {**entry, "parts": [None] * world if entry["kind"] == PRIVATE else []})
            part = entry["parts"][0]
            if entry["kind"] == PRIVATE:
                into["parts"][rank] = part
            elif entry["kind"] == SHARDED:
                box = (tuple(part[1]), tuple(report["index"][part[0]]["shape"]))
                if box not in {(tuple(p[1]), tuple(index[p[0]]["shape"])) for p in into["parts"]}:
                    into["parts"].append(part)  # a replicated placement is saved once
            else:
                into["parts"].append(part)
    return Manifest(
        step=step, epoch=epoch, world_size=world, files=files, tensors=index, state=reports[0]["state"],
        versions=versions, created=time.time(),
        distributed={"ranks": [r["state"] for r in sorted(reports, key=lambda r: r["rank"])], "tensors": merged},
    )


# ------------------------------------------------------------------ small JSON collectives


def broadcast_json(value: Any, group: Any) -> Any:
    """Rank 0's JSON-able ``value`` on every rank of ``group`` (no pickling)."""
    is_source = dist.get_rank() == dist.get_global_rank(group, 0)
    payload = _encode(value) if is_source else torch.empty(0, dtype=torch.uint8)
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    dist.broadcast(length, group=group, group_src=0)
    if not is_source:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(payload, group=group, group_src=0)
    return _decode(payload)


def all_gather_json(value: Any, group: Any) -> list[Any]:
    """Every rank's JSON-able ``value``, in rank order (no pickling)."""
    payload = _encode(value)
    size = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([payload.numel()], dtype=torch.int64), group=group)
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    return [_decode(g[: int(n.item())]) for g, n in zip(gathered, lengths)]


def _encode(value: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def _decode(payload: torch.Tensor) -> Any:
    return json.loads(bytes(payload.numpy()))
