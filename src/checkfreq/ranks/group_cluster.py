"""Checkpointing under ``torch.distributed``: what each rank writes, and the groups it talks on.

A :class:`GroupCluster` is the Checkpointer's :class:`~checkfreq.ranks.cluster.Cluster` when a default
process group is initialised (``torchrun``); users write no extra code. It creates dedicated gloo
groups and never uses the training process group after that:

* the **control** group, used only from the training thread: agreeing on *which* checkpoint to
  restore, and the start-up exchanges;
* the **vote** group, for a policy whose answer may differ between ranks, used only from each
  rank's vote thread: agreeing on *when* to checkpoint (:mod:`checkfreq.ranks.agreement`);
* the **commit** group, used only from each rank's background writer (:mod:`checkfreq.pipeline.save.commit`);
* the **upload** group, with a remote tier, used only from each rank's uploader
  (:mod:`checkfreq.pipeline.tiers.remote`).

Each group connects a pair of ranks only when the pair first exchanges a message (with torch >= 2.8,
:func:`checkfreq.ranks.compat.gloo_group_on_store`), so a rank holds connections to the few ranks it talks to.

Parameters and optimizer state, the same on every rank, are split over the ranks and verified
at each commit (:mod:`checkfreq.ranks.replicas`); everything else each rank writes for itself. See
docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from checkfreq.errors import CheckfreqError, PeerLostError
from checkfreq.policies import DecisionContext, Policy
from checkfreq.ranks import replicas
from checkfreq.ranks.agreement import VOTE_ACTIVITY, AgreedPolicy, needs_agreement
from checkfreq.ranks.collectives import GroupPeers, Peers, broadcast_message, collect_errors
from checkfreq.ranks.compat import default_store
from checkfreq.ranks.groups import new_gloo_groups
from checkfreq.ranks.liveness import SILENT_BEATS, Liveness
from checkfreq.ranks.messages import Token
from checkfreq.ranks.rebuild import Box, local_box, local_view, restore_targets, sharded_blocks
from checkfreq.ranks.shares import (
    PRIVATE,
    REPLICATED,
    SHARDED,
    Piece,
    Share,
    TensorRecord,
    chunked_dim,
    dtype_entry,
    kind_of,
    partition,
    piece_view,
    private_name,
    stream_range,
)
from checkfreq.ranks.sharing import directory_leader, on_machine_local_file_system
from checkfreq.run.state import flatten
from checkfreq.run.state import replicated as replicated_names
from checkfreq.run.tensors import local_part
from checkfreq.storage.base import Store
from checkfreq.storage.format import Manifest
from checkfreq.storage.local import LocalStore

log = logging.getLogger("checkfreq.distributed")

JOIN_TIMEOUT = 600.0
"""At most this many seconds for every rank to construct its Checkpointer (``persist_timeout`` if shorter)."""
_JOIN_WARNING_S = 30.0
ACTIVITIES = {
    "control": "the start-up or a restore",
    "commit": "a commit",
    "vote": VOTE_ACTIVITY,
    "upload": "an upload to the remote tier",
}
"""What the ranks do on each of checkfreq's groups, as a lost rank's error says (a commit and an upload
name their step)."""
_joins = itertools.count()


def wait_for_every_rank(
    world_size: int, timeout: float, store: dist.Store | None = None, join: int | None = None
) -> None:
    """Return once every rank has constructed its Checkpointer; raise after ``timeout`` seconds.

    The habit ``torch.save`` teaches (checkpoint on rank 0 only) would otherwise hang in the
    collective creation of the GroupCluster's groups, with no word of why. ``store``: the job's
    key-value store (the default group's when None); ``join``: which of this process's
    Checkpointers this is (counted here when None).
    """
    store = default_store() if store is None else store
    key = f"checkfreq/join/{_incarnation()}/{next(_joins) if join is None else join}"
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


def _incarnation() -> str:
    """What tells this incarnation's keys from an earlier one's in a store that outlives it.

    torchrun's workers share the agent's store across restarts (``TORCHELASTIC_USE_AGENT_STORE``):
    keys are told apart by the restart count. Otherwise (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
    as docs/distributed.md advises) each incarnation gets a fresh store, and the restart count must
    not be used: it counts one agent's own failures, so after a rank dies on one node the workers
    that another node's agent restarts keep the old count.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return "fresh-store"


def _on_device(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives on a device (its bytes are read only through the snapshot's copies)."""
    return tensor.device.type != "cpu" and not tensor.is_meta


class GroupCluster:
    """This rank's part in checkpointing under torch.distributed: its share of the state, its
    directory, its groups (a :class:`~checkfreq.ranks.cluster.Cluster`).

    Created collectively (every rank must construct its Checkpointer at the same point). The
    ranks agree on a token naming this job's staging locations and find out which of them share
    a local directory (one per node with node-local disks, one for all on a shared file system):
    the lowest rank of each takes its lock and clears its uncommitted leftovers, rank 0 those of
    the remote tier, before any rank goes on.
    """

    def __init__(
        self, local: Store, far: Sequence[Store], timeout: float, policy: Policy, failure_timeout: float = 30.0
    ) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        wait_for_every_rank(self.world_size, min(timeout, JOIN_TIMEOUT))
        vote = needs_agreement(policy)
        purposes = ["control", "commit", *(["vote"] if vote else []), *(["upload"] if far else [])]
        # every rank is here: agreeing on the token takes milliseconds unless a rank died. gloo's own
        # timeout is only a backstop: a rank may wait for a peer writing for up to persist_timeout
        prefix, made = new_gloo_groups(
            purposes, timedelta(seconds=min(timeout, failure_timeout)), timedelta(seconds=timeout + failure_timeout)
        )
        self.liveness = Liveness(
            dist.PrefixStore(f"{prefix}/liveness", default_store()), self.rank, self.world_size, failure_timeout
        )
        """The ranks' heartbeats: every wait on another rank is bounded by ``failure_timeout`` (docs/reliability.md)."""
        groups = {
            purpose: GroupPeers(group, self.liveness, ACTIVITIES[purpose])
            for purpose, group in zip(purposes, made, strict=True)
        }
        self.control, self.commit = groups["control"], groups["commit"]
        self.vote, self.upload = groups.get("vote"), groups.get("upload")
        self._plan: SharePlan | None = None
        self.token, self.directory_leader = meet(local, far, self.control)
        """The job's token, and the lowest rank that sees this rank's local directory: it holds the lock and commits."""
        self.leader = self.directory_leader == self.rank
        self.page_cache = page_cache(local, self.directory_leader)
        self.writes_whole_state = False
        """Every rank writes a share (even alone): its data file holds per-rank names and an index."""
        self.others_wait = self.world_size > 1
        """Other ranks wait on this one (a 1-rank job has none to tell when it leaves)."""
        self._decider = None if self.vote is None else AgreedPolicy(policy, self.vote, timeout, self.liveness)
        self.decide: Callable[[DecisionContext], bool] = (
            policy.should_save if self._decider is None else self._decider.should_save
        )
        """``policy.should_save``, agreed by all ranks (a step-count policy needs no messages)."""

    # -------------------------------------------------------------- training thread

    def select(
        self,
        tensors: Mapping[str, torch.Tensor],
        owned: set[str],
        objects: Mapping[str, Any],
        on_device: Callable[[torch.Tensor], bool] = _on_device,
    ) -> tuple[dict[str, torch.Tensor], set[str], Share]:
        """This rank's share of ``tensors`` (the state of ``objects``): (arrays to write, which of
        them are fenced, their index).

        The tensors that are the same on every rank (the parameters and optimizer state of
        ``objects``) are split over the ranks, and fingerprinted for rank 0 to verify at the commit
        (:mod:`checkfreq.ranks.replicas`): those ``on_device`` says live on a device are left for
        the snapshot to copy (``Share["later"]``), never read here. Every other tensor is written
        by each rank for itself.
        """
        replicated = replicated_names(tensors, objects)
        names = sorted(n for n, t in tensors.items() if kind_of(n, t, replicated) == REPLICATED)
        layout = tuple((n, str(tensors[n].dtype), tuple(tensors[n].shape)) for n in names)
        if self._plan is None or self._plan.layout != layout:
            self._plan = SharePlan.of(layout, {n: tensors[n] for n in names}, self.world_size, self.rank)
            checked = self._plan.verify_first(device=any(on_device(tensors[n]) for n in names))
        else:
            checked = self._plan.verify_next()
        plan = self._plan
        claim, later = replicas.claim(layout, {_label(p): piece_view(tensors[p.name], p) for p in checked}, on_device)
        arrays = {piece.stored_name: piece_view(tensors[piece.name], piece) for piece in plan.pieces}
        own: dict[str, TensorRecord] = {}  # this rank's tensors but its replicated pieces: in its file's header
        shared = dict(plan.shared)  # what every rank records the same: in the manifest
        meshes: dict[int, bool] = {}
        for name, tensor in tensors.items():
            kind = kind_of(name, tensor, replicated)
            if kind == REPLICATED:
                continue
            stored = private_name(name, self.rank)
            if kind == SHARDED:
                arrays[stored] = local_part(tensor)
                offset, _ = local_box(tensor)
                own[name] = _entry(tensor, SHARDED, [[stored, list(offset)]])
                shared[name] = _entry(tensor, SHARDED, [])
                dim = chunked_dim(tensor, self.world_size, meshes)
                if dim is not None:  # where each rank's shard lies, for a restore at another world size
                    shared[name]["chunked"] = dim
            else:
                arrays[stored] = tensor
                own[name] = _entry(tensor, PRIVATE, [stored])
        fenced = {p.stored_name for p in plan.pieces if p.name in owned} | {
            private_name(n, self.rank) for n in own if n in owned
        }
        return arrays, fenced, Share(rank=own, shared=shared, replicas=claim, plan=plan.digest, later=later)

    def view(
        self, manifest: Manifest, stored: Mapping[str, torch.Tensor], objects: Mapping[str, Any]
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        """This rank's skeleton and tensors, DTensors cut to the placement of the live ones."""
        return local_view(manifest, stored, self.rank, _targets(manifest, list(stored), objects))

    def blocks(self, manifest: Manifest, objects: Mapping[str, Any]) -> dict[str, Box]:
        """The block of each sharded tensor of ``manifest`` that this rank restores into ``objects``."""
        return sharded_blocks(manifest, _targets(manifest, [], objects))

    @property
    def failure(self) -> PeerLostError | None:
        """Why the job failed (a rank lost, or left on an error), once this rank knows."""
        return self.liveness.failure

    def leave(self, error: BaseException, seconds: float) -> None:
        """Tell every rank that this one leaves on ``error``: their waits on it end at once. If
        ``error`` looks like a lost peer's, first watch the heartbeats for at most ``seconds``."""
        liveness = self.liveness
        if liveness.failure is None and seconds > 0 and looks_like_a_lost_peer(error):
            # only to name the rank (this one leaves anyway)
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            silence = SILENT_BEATS * liveness.interval
            liveness.find_lost(
                f"training (this rank failed with {type(error).__name__}: {first_line})",
                min(seconds, silence + 2 * liveness.interval),
                silence=silence,
            )
        if liveness.failure is None:  # this rank's own error: the other ranks end, it goes on as its caller decides
            liveness.give_up(f"rank {self.rank} left on {type(error).__name__}: {error}", end_process=False)

    def close(self) -> None:
        """Finish the vote in flight (every rank has started the same number)."""
        if self._decider is not None:
            self._decider.close()

    def release(self) -> None:
        """Destroy checkfreq's groups once the writer and the uploader have stopped, so that a
        process that creates Checkpointers in turn (a sweep, a test suite) does not pile up gloo
        connections and threads, and none is left for the interpreter's exit to tear down.

        Destroying a gloo group is local: a peer still finishing its last message on it gets it,
        as the data already sent precedes the closed connection.
        """
        self.liveness.stop()
        if not dist.is_initialized():  # the user destroyed every group already
            return
        for peers in (self.control, self.commit, self.vote, self.upload):
            if peers is not None:
                peers.close()
                with contextlib.suppress(ValueError):  # gone with a default group the user replaced
                    dist.destroy_process_group(peers.group)


_LOST_PEER_WORDS = ("connection closed", "connection reset", "connection refused", "broken pipe", "timed out")


def looks_like_a_lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is torch.distributed's word for a peer gone (gloo's closed connection, a timeout)."""
    if isinstance(error, PeerLostError):
        return True
    dist_error = getattr(dist, "DistError", None)
    if not isinstance(error, RuntimeError) and not (dist_error is not None and isinstance(error, dist_error)):
        return False
    text = str(error).lower()
    return any(word in text for word in _LOST_PEER_WORDS)


@dataclass
class SharePlan:
    """The replicated layout this rank plans for: its share, and what each checkpoint verifies."""

    layout: replicas.Signature
    sizes: list[tuple[str, int, int]]
    """(name, numel, itemsize) of every replicated tensor."""
    pieces: list[Piece]
    """This rank's share of the replicated bytes."""
    shared: dict[str, TensorRecord]
    """The manifest's entry of every replicated tensor: its pieces on every rank, in rank order."""
    digest: str
    """xxh3-64 of ``shared`` (O(T + N) bytes of JSON), computed once: what each commit's agreement
    digest covers of the replicated tensors."""
    checks: int = 0

    @classmethod
    def of(
        cls, layout: replicas.Signature, tensors: Mapping[str, torch.Tensor], world_size: int, rank: int
    ) -> SharePlan:
        sizes = [(n, t.numel(), t.element_size()) for n, t in tensors.items()]
        plans = partition(sizes, world_size)
        shared: dict[str, TensorRecord] = {}
        for pieces in plans:
            for piece in pieces:
                entry = shared.setdefault(piece.name, _entry(tensors[piece.name], REPLICATED, []))
                entry["parts"].append([piece.stored_name, piece.begin, piece.end])
        digest = xxhash.xxh3_64_hexdigest(json.dumps(shared, sort_keys=True, separators=(",", ":")).encode())
        return cls(layout, sizes, plans[rank], shared, digest)

    def verify_first(self, *, device: bool) -> list[Piece]:
        """The layout was just planned: every tensor whole, or with the state on a ``device`` the head
        of every tensor, at most :data:`~checkfreq.ranks.replicas.FIRST_DEVICE_BYTES` in all (the
        host memory its copies take; the windows of :meth:`verify_next` cover the rest in turn)."""
        if not device:
            return [Piece(name, 0, numel, True) for name, numel, _ in self.sizes]
        head = replicas.FIRST_DEVICE_BYTES // max(1, len(self.sizes))
        pieces = []
        for name, numel, itemsize in self.sizes:
            end = min(numel, max(1, head // itemsize))
            pieces.append(Piece(name, 0, end, end == numel))
        return pieces

    def verify_next(self) -> list[Piece]:
        """The next window of at most :data:`~checkfreq.ranks.replicas.VERIFY_BYTES` of the bytes, in turn."""
        self.checks += 1
        total = sum(numel * itemsize for _, numel, itemsize in self.sizes)
        windows = max(1, -(-total // replicas.VERIFY_BYTES))
        k = self.checks % windows
        return stream_range(self.sizes, k * total // windows, (k + 1) * total // windows)


def _targets(manifest: Manifest, stored: list[str], objects: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The live DTensor of ``objects`` each saved tensor is restored to, by saved name (the
    manifest's names, else those of the ``stored`` arrays)."""
    _, live = flatten({n: o.state_dict() for n, o in objects.items()}, allow_pickle=True)
    optimizers = {n: o for n, o in objects.items() if isinstance(o, torch.optim.Optimizer)}
    saved = manifest.distributed.get("tensors") if manifest.distributed else None
    return restore_targets(live, optimizers, list(saved) if isinstance(saved, dict) else stored)


def _label(piece: Piece) -> str:
    """A piece as people read it: the tensor's name, with the range of its flattened elements if partial."""
    return piece.name if piece.whole else f"{piece.name}[{piece.begin}:{piece.end}]"


def _entry(tensor: torch.Tensor, kind: str, parts: list[Any]) -> TensorRecord:
    return {"dtype": dtype_entry(tensor), "shape": list(tensor.shape), "kind": kind, "parts": parts}


def meet(local: Store, far: Sequence[Store], peers: Peers) -> tuple[str, int]:
    """The token naming this job's staging locations (rank 0's) and this rank's directory leader,
    each directory opened once (:func:`open_directories`). Collective, over ``peers``."""
    mine = Token(uuid.uuid4().hex[:12]) if peers.rank == 0 else None
    token = broadcast_message(peers, mine, Token.from_wire).token
    directory = directory_leader(local, token, peers)
    open_directories(local, far, peers, leader=directory == peers.rank)
    return token, directory


def page_cache(local: Store, leader: int) -> int | None:
    """What tells the ranks that read their directory through one page cache (the ``page_cache``
    of :class:`~checkfreq.pipeline.restore.Restorer`): the directory's leader where it is a directory on a
    machine-local file system, else None."""
    return leader if isinstance(local, LocalStore) and on_machine_local_file_system(local.root) else None


def open_directories(local: Store, far: Sequence[Store], peers: Peers, *, leader: bool) -> None:
    """Lock each directory once and clear its uncommitted leftovers: ``local`` on its leader,
    each of ``far`` (the remote tier) on rank 0. Every rank hears of a failure. Collective."""
    own: BaseException | None = None
    try:
        if leader:
            local.lock()
            local.remove_staging()
        for store in far if peers.rank == 0 else ():
            store.lock()
            store.remove_staging()
    except (OSError, CheckfreqError) as e:
        own = e
    failed = collect_errors(peers, None if own is None else f"rank {peers.rank}: {own}")
    if own is not None:
        raise own
    if failed:
        raise CheckfreqError(f"another rank could not open its checkpoint directory: {'; '.join(failed)}")
