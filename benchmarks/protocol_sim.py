"""checkfreq's distributed protocol at N ranks, each rank's real code on a thread of its own.

Usage: ``python benchmarks/protocol_sim.py [--worlds 64,1024,4096,16384] [--restore-up-to 64] [--state fsdp2]
[--own-bytes 1048576] [--replicas 1]``

Every rank runs checkfreq's own code: start-up (``wait_for_every_rank`` and ``agree_on_token`` over a
key-value store, then ``ranks.group_cluster.meet``: the job's token, who shares a directory, each
directory opened), a memory tier's start-up (``ranks.sharing.memory_group``: which ranks share a machine,
8 to a machine, and with ``replicas=k`` (``--replicas``, 1 by default) the k ranks each rank copies its
snapshots to and whose it keeps), one commit (``pipeline.save.commit.Committer.run``, which writes a real data
file per rank and rank 0's ``manifest.json`` into one shared directory), three exchanges of the vote on
when to checkpoint (``ranks.collectives.tree_max``, what ``ranks.agreement.AgreedPolicy``'s vote thread
runs), the fetch round after machine 1 is lost with its memory and disk
(``pipeline.restore.copies.fetch_copies``: every rank's report gathered on rank 0, its plan broadcast,
each copy sent by its first keeper to the rank that lost it, then a ``tree_max`` of one flag per such
rank, and the errors gathered and broadcast; what each rank holds: ``benchmarks/replica_sim.py``'s
``Loss``), and the restore (``pipeline.restore.Restorer.find``: the choice of step, rank 0's plan, each
file read and verified by one rank, and the replicated tensors all-gathered; the directory is taken for
one on a network file system, where no two ranks share a page cache, as in a job of many nodes).
What stands in for the real thing:

* the transport: :class:`MemoryPeers` implements :class:`checkfreq.ranks.collectives.Peers` in memory.
  Collectives are matched by their order, point-to-point messages by (sender, receiver). A message
  counts as ``tests/distributed/test_scale.py`` counts it on real gloo groups (:class:`CountingPeers`, shared
  with that test): its JSON and an 8-byte length; a gather is each rank's message to rank 0, a
  broadcast rank 0's message to each rank, an all-gather each rank's message to every other rank.
  A rank's *connections* are the distinct ranks it exchanged messages with (gloo pairs connected
  on first use);
* the key-value store: :class:`MemoryStore`, the operations of ``torch.distributed.Store`` that
  start-up uses, each call counted as one operation (a round trip; :class:`CountingStore`); an ``add``
  of 0 is a poll;
* the training: each rank's snapshot is the state of a DDP job (``--layers`` linear layers and
  AdamW, 8 replicated tensors a layer, split over the ranks by checkfreq's plan, and each rank's
  random-generator tensors), zeros, built with ``benchmarks/scale_costs.py``'s helpers; with
  ``--state fsdp2``, the same tensors under FSDP2: each rank holds block ``rank`` of every
  parameter's and optimizer state's rows (``Shard(0)``), as ``GroupCluster.select`` records it,
  and restores the same blocks (AdamW's step counts stay replicated).

All-gathered lists are decoded once and shared by the ranks that receive them (the protocol code
only reads them), so the JSON parse of an all-gather is in no rank's CPU time; a gather's and a
broadcast's are in the receiver's. A rank's CPU time is ``time.thread_time()`` of its thread
but for what the thread spends blocked in the transport or the store, waking the ranks its
messages and store writes reach, and carrying point-to-point messages (the transport's own work);
one rank computes at a time and wakes the others only when it waits (:class:`Baton`), and the
cyclic garbage collector is off while the ranks run, so that neither thousands of threads
contending for the interpreter nor a collection of every rank's objects is counted as some rank's
work.

The restore runs on every rank up to ``--restore-up-to`` ranks (each rank receives a row from every rank,
so the simulator's restore moves O(N²) bytes in all); above, what it would cost is
measured alone: rank 0's plan (``restore.plan.ReadPlan``) over N views (on one shared directory, every
rank's view is rank 0's, built by the restorer's own code), and what every rank computes of the
stream (``restore.stream.ReplicatedStream``: its layout, and the replicated tensors taken out of the N rows).

Each snapshot's copies on other machines (the "snapshot copy" phase) is not run on the ranks'
threads: ``benchmarks/replica_sim.py`` runs real ``ReplicaLink`` links for the first and the last machine's
ranks (each sends what ``pipeline.tiers.memory.replica_parts.outgoing`` makes of its slot: no replicated state)
and gives each rank the counts of the copies it sends and of those it keeps, by the ring the
start-up computes; it also times rank 0's ``fetch_plan`` over N reports.

Prints, per N and phase, each count for rank 0 and the median and maximum over the other ranks
(``benchmarks/sim_report.py``), the copies' figures per N, and a verdict per acceptance criterion.
The transport and the store are in ``benchmarks/sim_transport.py``, the counting in
``benchmarks/sim_counts.py``, what a world's run produced (:class:`Run`) in ``benchmarks/sim_results.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.replica_sim import (  # noqa: E402
    DISK_STEP,
    OWN_BYTES,
    RANKS_PER_MACHINE,
    REPLICAS,
    STRIDE,
    KeptCopies,
    Loss,
    copy_counts,
    measured_senders,
    per_snapshot,
    plan_seconds,
    sent,
    slot,
)
from benchmarks.scale_costs import PRIVATE_TENSORS, costs, replicated_state, skeleton  # noqa: E402
from benchmarks.sim_counts import CountedLocalStore, CountingPeers, CountingStore, Counts, Ledger, message_bytes  # noqa: E402
from benchmarks.sim_report import COPY_PHASE, figure, replica_table, rows, summary, verdicts  # noqa: E402
from benchmarks.sim_results import Outcome, Run  # noqa: E402
from benchmarks.sim_transport import REAL_SLEEP, TIMEOUT_S, Baton, Fabric, MemoryPeers, MemoryStore  # noqa: E402
from checkfreq.pipeline.capture.snapshot import PendingSnapshot, aligned_empty  # noqa: E402
from checkfreq.pipeline.restore import Found, Restorer  # noqa: E402
from checkfreq.pipeline.restore.copies import fetch_copies  # noqa: E402
from checkfreq.pipeline.restore.plan import ReadPlan, fetch_plan  # noqa: E402
from checkfreq.pipeline.restore.readable import Readable  # noqa: E402
from checkfreq.pipeline.restore.stream import ReplicatedStream  # noqa: E402
from checkfreq.pipeline.retention.retainer import Retainer  # noqa: E402
from checkfreq.pipeline.save.commit import CommitJob, Committer  # noqa: E402
from checkfreq.pipeline.tiers.chosen import LocalTier, Tiers  # noqa: E402
from checkfreq.pipeline.tiers.roles import TierName  # noqa: E402
from checkfreq.policies.retention import Retention  # noqa: E402
from checkfreq.ranks import replicas  # noqa: E402
from checkfreq.ranks.collectives import Peers, Solo, tree_max  # noqa: E402
from checkfreq.ranks.group_cluster import SharePlan, meet, wait_for_every_rank  # noqa: E402
from checkfreq.ranks.groups import agree_on_token  # noqa: E402
from checkfreq.ranks.rebuild import Box  # noqa: E402
from checkfreq.ranks.shares import PRIVATE, SHARDED, partition, private_name  # noqa: E402
from checkfreq.ranks.sharing import memory_group  # noqa: E402
from checkfreq.storage.format import DTYPE_CODES, plan_layout  # noqa: E402
from checkfreq.storage.local import LocalStore  # noqa: E402

WORLDS = "64,1024,4096,16384"
LAYERS = 50
"""50 linear layers and AdamW: 400 replicated tensors."""
STEP = 100
STACK_BYTES = 256 << 10
"""Each rank thread's stack: 16,384 threads reserve 4 GiB of address space, of which they touch little."""


# ------------------------------------------------------------------------------------- the ranks


@dataclass
class Job:
    """What every rank checkpoints: the replicated plan (the same on every rank) and the state's tensors."""

    tensors: dict[str, torch.Tensor]
    plan: SharePlan
    pieces: list[list[Any]]
    """Each rank's pieces of the replicated tensors (``ranks.shares.partition``)."""
    claim: dict[str, Any]
    skeleton: dict[str, Any]
    """The state's skeleton, one object for every rank (the protocol only reads it)."""
    sharded: dict[str, torch.Tensor] = field(default_factory=dict)
    """Under FSDP2, the tensors each rank holds a block of: block ``rank`` of their rows as
    ``torch.chunk`` cuts them (``Shard(0)`` over every rank in order)."""

    @classmethod
    def of(cls, world: int, layers: int, state: str = "ddp") -> Job:
        """``state``: ``"ddp"`` (every tensor replicated) or ``"fsdp2"`` (every parameter and its
        optimizer state sharded; AdamW's step counts, plain tensors, replicated)."""
        everything = replicated_state(layers)
        sharded = {n: t for n, t in everything.items() if state == "fsdp2" and t.dim()}
        tensors = {n: t for n, t in everything.items() if n not in sharded}
        names = sorted(tensors)
        layout = tuple((n, str(tensors[n].dtype), tuple(tensors[n].shape)) for n in names)
        plan = SharePlan.of(layout, tensors, world, 0)
        claim = replicas.report(layout, {n: replicas.fingerprint(tensors[n]) for n in names})
        return cls(tensors, plan, partition(plan.sizes, world), claim, skeleton(everything), sharded)

    def blocks(self, rank: int) -> dict[str, Box]:
        """Rank ``rank``'s block of each sharded tensor."""
        return {name: chunk_block(tuple(t.shape), len(self.pieces), rank) for name, t in self.sharded.items()}

    def commit_job(self, rank: int) -> CommitJob:
        """Rank ``rank``'s snapshot, as ``GroupCluster.select`` shares it out."""
        arrays = {p.stored_name: (self.tensors[p.name].dtype, (p.end - p.begin,)) for p in self.pieces[rank]}
        own: dict[str, Any] = {}
        for name, (dtype, shape) in PRIVATE_TENSORS.items():
            stored = private_name(name, rank)
            arrays[stored] = (dtype, shape)
            own[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "kind": PRIVATE, "parts": [stored]}
        shared = dict(self.plan.shared)
        for name, (offset, shape) in self.blocks(rank).items():
            stored, entry = (
                private_name(name, rank),
                {
                    "dtype": DTYPE_CODES[self.sharded[name].dtype],
                    "shape": list(self.sharded[name].shape),
                    "kind": SHARDED,
                },
            )
            arrays[stored] = (self.sharded[name].dtype, shape)
            own[name] = {**entry, "parts": [[stored, list(offset)]]}
            shared[name] = {**entry, "parts": [], "chunked": 0}  # as GroupCluster.select records FSDP2's layout
        layout = plan_layout(arrays)
        buffer = aligned_empty(layout.nbytes, False)
        buffer.zero_()
        pending = PendingSnapshot(layout, buffer, [])
        share = {"rank": own, "shared": shared, "replicas": self.claim, "plan": self.plan.digest, "later": {}}
        return CommitJob(STEP, 0, pending, self.skeleton, share, {"checkfreq": "sim"}, time.perf_counter())


def chunk_block(shape: tuple[int, ...], parts: int, index: int) -> Box:
    """Block ``index`` of the ``parts`` that ``torch.chunk`` cuts the rows of a tensor of ``shape`` into."""
    step = -(-shape[0] // parts)
    begin = min(index * step, shape[0])
    return (begin, *[0] * (len(shape) - 1)), (min(step, shape[0] - begin), *shape[1:])


VOTES = 3
"""Exchanges of the vote per simulated run (one every quarter second of training in a real job)."""


def vote(peers: Peers) -> None:
    """:data:`VOTES` exchanges of the vote that agrees on *when* to checkpoint: the tree maximum
    that ``ranks.agreement.AgreedPolicy``'s vote thread runs (``ranks.collectives.tree_max``), each rank
    proposing (its wish, minus the steps to the next exchange)."""
    for _ in range(VOTES):
        tree_max(peers, torch.tensor([peers.rank % 2, -(1 + peers.rank % 7)], dtype=torch.int64))


def _rank(
    rank: int,
    world: int,
    root: Path,
    fabric: Fabric,
    kv: MemoryStore,
    ledger: Ledger,
    checkpoint: Job,
    start: threading.Event,
    restore: bool,
    loss: Loss,
    outcomes: list[Any],
) -> None:
    try:
        with fabric.baton.held():
            _run_rank(rank, world, root, fabric, kv, ledger, checkpoint, start, restore, loss, outcomes)
    except BaseException as e:  # noqa: BLE001 - reported by the caller with the rank
        outcomes[rank] = e


def _run_rank(
    rank: int,
    world: int,
    root: Path,
    fabric: Fabric,
    kv: MemoryStore,
    ledger: Ledger,
    checkpoint: Job,
    start: threading.Event,
    restore: bool,
    loss: Loss,
    outcomes: list[Any],
) -> None:
    job = checkpoint.commit_job(rank)
    peers = CountingPeers(MemoryPeers(fabric, rank), ledger)
    store = CountingStore(kv, ledger)
    local = CountedLocalStore(root, ledger)
    fabric.wait(start, rank, "the start")
    with ledger.phase("startup"):
        wait_for_every_rank(world, TIMEOUT_S, store, join=0)  # type: ignore[arg-type]
        agree_on_token(store, "checkfreq/groups/control+commit", rank, world, timedelta(seconds=TIMEOUT_S))  # type: ignore[arg-type]
        token, directory = meet(local, [], peers)
    with ledger.phase("memory group"):  # a memory tier's start-up: which ranks share a machine, and the copies' ring
        members = memory_group(peers, f"machine {rank // RANKS_PER_MACHINE}", loss.replicas, STRIDE)
    leader = directory == rank
    with ledger.phase("commit"):
        committer = Committer(
            local,
            peers,
            leader=leader,
            token=token,
            directory_leader=directory,
            retainer=Retainer(local, Retention(3), leader=leader),
        )
        result = committer.run(job)
    with ledger.phase("vote"):
        vote(peers)
    kept = KeptCopies(loss.report(rank, members.receives_from), loss.copy_bytes)
    with ledger.phase("fetch round"):  # one machine lost: its ranks take their snapshots from the copies kept
        fetched = fetch_copies(Tiers([kept, LocalTier(local)]), peers, None if loss.is_lost(rank) else DISK_STEP)
    found: Found | None = None
    if restore:
        with ledger.phase("restore"):
            blocks = (lambda manifest: checkpoint.blocks(rank)) if checkpoint.sharded else None
            # no page cache shared: a network file system
            found = Restorer(Tiers([LocalTier(local)]), peers, directory_leader=directory).find(blocks=blocks)
    if leader:
        local.unlock()
    outcomes[rank] = Outcome(
        token,
        directory,
        result,
        "" if found is None else found.name,
        0 if found is None else len(found.manifest.files),
        fetched,
        len(kept.adopted),
    )


def simulate(
    world: int,
    *,
    layers: int = LAYERS,
    restore_up_to: int = 64,
    directory: str | None = None,
    state: str = "ddp",
    own_bytes: int = OWN_BYTES,
    replicas: int = REPLICAS,
) -> Run:
    """Run start-up, one commit, the fetch round after a machine's loss and (up to ``restore_up_to``
    ranks) the restore on ``world`` rank threads, checkpointing a DDP or an FSDP2 ``state``
    (:meth:`Job.of`); count one snapshot's copies to ``replicas`` keepers each, with ``own_bytes``
    of each rank's own state."""
    job = Job.of(world, layers, state)
    loss = Loss(world, RANKS_PER_MACHINE, replicas=replicas)
    baton = Baton()
    ledgers = [Ledger(baton) for _ in range(world)]
    fabric, kv = Fabric(world, baton), MemoryStore(baton)
    outcomes: list[Any] = [None] * world
    restore = world <= restore_up_to
    start = threading.Event()
    with tempfile.TemporaryDirectory(prefix="checkfreq-sim-", dir=directory) as tmp:
        root = Path(tmp) / "ckpt"
        root.mkdir()
        previous = threading.stack_size(STACK_BYTES)
        time.sleep = baton.sleep  # the protocol's polls pass the baton
        gc.disable()  # else a collection of every rank's objects lands in the CPU time of whatever triggers it
        began = time.perf_counter()
        try:
            threads = [
                threading.Thread(
                    target=_rank,
                    name=f"sim-rank-{r}",
                    daemon=True,
                    args=(r, world, root, fabric, kv, ledgers[r], job, start, restore, loss, outcomes),
                )
                for r in range(world)
            ]
            for thread in threads:
                thread.start()
        finally:
            threading.stack_size(previous)
        threads_s = time.perf_counter() - began
        start.set()
        try:
            for thread in threads:
                thread.join()
            wall_s = time.perf_counter() - began
            failed = [(r, o) for r, o in enumerate(outcomes) if not isinstance(o, Outcome)]
            if failed:
                rank, error = failed[0]
                raise RuntimeError(f"{len(failed)} simulated ranks failed; rank {rank}: {error!r}") from (
                    error if isinstance(error, BaseException) else None
                )
            first = outcomes[0]
            ended = {(o.token, o.directory, o.commit.step, o.restored, o.restored_files, o.fetched) for o in outcomes}
            if ended != {
                (first.token, first.directory, first.commit.step, first.restored, first.restored_files, first.fetched)
            }:
                raise RuntimeError(f"the ranks ended differently: {sorted(ended, key=str)[:4]}")
            reader = LocalStore(root, create=False)
            ((_, location),) = reader.checkpoints()
            manifest_bytes = (location / "manifest.json").stat().st_size
            parse: list[float] = []
            for _ in range(3):
                began = time.thread_time()
                manifest = reader.read_manifest(location)
                parse.append(time.thread_time() - began)
            readable = _readable(reader, STEP)
            own = readable.holdings(None, 0, [0])  # every rank's but for what it needs (its digest of the files: O(N))
            views = [dataclasses.replace(own, needs=[rank]) for rank in range(world)]
            began = time.thread_time()
            stream = readable.stream
            assert stream is not None
            plan = ReadPlan(readable.manifest, views, streamable=True, replicated=bool(stream.tensors))
            plan.orders()
            plan.after([{}] * world)
            plan_cpu_s = time.thread_time() - began
            readers = {name: [rank] for name, rank in plan.reader.items()}
            stream = ReplicatedStream.of(manifest)  # what every rank computes once (rank 0's plan cached its own)
            assert stream is not None
            rows = torch.zeros(world, stream.width, dtype=torch.uint8)  # each rank's row: its own file
            rows.view(torch.int64)[:, 0] = torch.arange(world)
            began = time.thread_time()
            computed = ReplicatedStream.of(manifest)
            assert computed is not None
            computed.tensors_of(rows)
            stream_cpu_s = time.thread_time() - began
            stream_bytes = stream.width * (world - 1)  # every other rank's row
            file_bytes = [manifest.files[name]["size"] for name in sorted(manifest.files)]
        finally:
            time.sleep = REAL_SLEEP
            gc.enable()
    kept = _count_copies(world, layers, own_bytes, ledgers, directory, replicas)
    slot_bytes = copy_sent_bytes = 0
    if kept:
        data_bytes, meta = slot(world, 0, RANKS_PER_MACHINE, layers, own_bytes)
        slot_bytes, copy_sent_bytes = data_bytes + len(meta), sum(sent(world, 0, RANKS_PER_MACHINE, layers, own_bytes))
    reports = loss.reports()
    fetch_plan_s, fetch_decode_s = plan_seconds(reports)
    return Run(
        world,
        replicas,
        wall_s,
        threads_s,
        ledgers,
        outcomes,
        manifest_bytes,
        statistics.median(parse),
        restore,
        plan_cpu_s,
        stream_cpu_s,
        stream_bytes,
        readers,
        file_bytes,
        kept,
        slot_bytes,
        copy_sent_bytes,
        [message_bytes(report.to_wire()) for report in reports],
        message_bytes(fetch_plan(reports).to_wire()),
        fetch_plan_s,
        fetch_decode_s,
    )


def _count_copies(
    world: int, layers: int, own_bytes: int, ledgers: list[Ledger], directory: str | None, replicas: int = REPLICAS
) -> int:
    """Each rank's counts for one snapshot's copies (:data:`COPY_PHASE`), from real copies of the
    first and the last machine's snapshots (``benchmarks/replica_sim.py``); how many were kept (none
    counted on one machine, which copies nowhere, or with a last machine smaller than the others)."""
    if world < 2 * RANKS_PER_MACHINE or world % RANKS_PER_MACHINE:
        return 0
    copied = copy_counts(
        world,
        measured_senders(world, RANKS_PER_MACHINE),
        per_machine=RANKS_PER_MACHINE,
        layers=layers,
        own_bytes=own_bytes,
        directory=directory,
        replicas=replicas,
    )
    for ledger, link in zip(ledgers, per_snapshot(world, RANKS_PER_MACHINE, copied, replicas), strict=True):
        ledger.phases[COPY_PHASE] = Counts(
            messages_out=link.messages_out,
            messages_in=link.messages_in,
            bytes_out=link.bytes_out,
            bytes_in=link.bytes_in,
            peers=link.peers,
        )
    return len(copied.kept)


def _readable(store: LocalStore, step: int) -> Readable:
    """What a rank of a shared directory has of checkpoint ``step`` at restore, by the restorer's own
    code (on one shared directory every rank's is rank 0's)."""
    restorer = Restorer(Tiers([LocalTier(store)]), Solo())
    restorer._locations = {TierName.LOCAL: dict(store.checkpoints())}
    readable = restorer._readable(step)
    assert not isinstance(readable, str), readable
    return readable


# ------------------------------------------------------------------------------------- the report


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default=WORLDS, help="comma-separated numbers of ranks")
    parser.add_argument("--layers", type=int, default=LAYERS, help="linear layers of the DDP model (8 tensors each)")
    parser.add_argument("--restore-up-to", type=int, default=64, help="run the restore on every rank up to this N")
    parser.add_argument(
        "--state", choices=("ddp", "fsdp2"), default="ddp", help="what the ranks checkpoint and restore"
    )
    parser.add_argument(
        "--dir",
        default="/dev/shm" if Path("/dev/shm").is_dir() else None,
        help="where the checkpoint directory is made (a tmpfs keeps 16k files' writes cheap)",
    )
    parser.add_argument(
        "--own-bytes",
        type=int,
        default=OWN_BYTES,
        help="each rank's own (not replicated) state in a memory snapshot, copied to another machine",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=REPLICAS,
        help="the copies of each memory snapshot, each on another machine (replicas=k)",
    )
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    sums = []
    print("| N | phase | count | rank 0 | other ranks: median | max |\n| --- | --- | --- | --- | --- | --- |")
    for world in worlds:
        run = simulate(
            world,
            layers=args.layers,
            restore_up_to=args.restore_up_to,
            directory=args.dir,
            state=args.state,
            own_bytes=args.own_bytes,
            replicas=args.replicas,
        )
        for row in rows(run):
            print(
                f"| {row['world']:,} | {row['phase']} | {row['count']} | {figure(row['rank0'])} | "
                f"{figure(row['median'])} | {figure(row['max'])} |",
                flush=True,
            )
        sums.append(summary(run))
        print(json.dumps(sums[-1]), flush=True)
    fsdp2 = {world: costs(world, "fsdp2", args.layers)["manifest_bytes"] for world in worlds}
    print("\n".join(replica_table(sums)))
    for name, ok, numbers in verdicts(sums, fsdp2, args.layers):
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {numbers}")


if __name__ == "__main__":
    main()
