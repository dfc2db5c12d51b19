"""Phase 2's commit protocol: the same code for one process and for N ranks.

A checkpoint is committed in three rounds of small messages between the ranks (a world of one
passes them to itself, :class:`~checkfreq.ranks.collectives.Solo`):

1. *prepare*: the leader of each local directory (the lowest rank that sees it; every rank when
   directories are node-local) creates the checkpoint's staging location in its store;
2. *report*: every rank writes its own data file (``rankNNNNN.safetensors``) through the store,
   fsynced, with its skeleton and its own tensors' index in the file's header, and reports a few
   fixed-size fields: ok or its error, the file's size and checksum, and a digest of what the ranks
   must agree on (the replicated and sharded tensors, and the replicas' fingerprints), to rank 0
   only; rank 0 judges them and broadcasts its verdict (a rank failed, or the replicated state
   differs: only then the ranks exchange their claims in full, to say what differs), and sends the
   reports to the other directories' leaders;
3. *outcome*: each leader writes ``manifest.json`` last, through the store, and commits it
   (an atomic rename on a local disk; the manifest itself on an object store); the ranks hear
   whether every leader committed. Every round is gathered on rank 0 and answered by a broadcast,
   so a rank other than 0 (and not a leader) sends and receives O(1) bytes per checkpoint. The
   manifest holds nothing per rank but each file's size and checksum
   (:class:`~checkfreq.storage.format.Manifest`), so a rank's report and the manifest's growth per rank stay
   the same at any world size.

Then retention: each leader reads back the checkpoints that hold a slot of ``keep`` before it deletes
one in their favour (:mod:`checkfreq.pipeline.retention.readback`); with node-local directories the
leaders first tell each other, through rank 0, which they found damaged (one gather and one broadcast
of a few step numbers, again while a leader finds more), so that every directory sets them aside.

The job is a value (:class:`CommitJob`) and the answer too (:class:`CommitResult`): the writer
thread runs :meth:`Committer.run` and the training thread applies its result.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from checkfreq.errors import PersistError, ReplicaMismatchError
from checkfreq.pipeline.capture.snapshot import PendingSnapshot
from checkfreq.pipeline.retention.best import score_entry
from checkfreq.pipeline.retention.retainer import Retainer
from checkfreq.pipeline.tiers.roles import CommitFollower
from checkfreq.ranks import replicas
from checkfreq.ranks.collectives import (
    JSON,
    Peers,
    all_gather_messages,
    broadcast_message,
    collect_errors,
    during,
    gather_messages,
    receive_message,
    send_message,
)
from checkfreq.ranks.replicas import ReplicaClaim
from checkfreq.ranks.shares import REPLICATED, SHARDED, Share, TensorRecord
from checkfreq.storage.base import Store, write_data, write_manifest
from checkfreq.storage.format import FileEntry, Manifest, data_file_name, encode_header, tensor_entries

log = logging.getLogger("checkfreq.commit")


@dataclass(frozen=True)
class CommitJob:
    """What to write: one snapshot of this rank, taken at ``step``."""

    step: int
    epoch: int | None
    pending: PendingSnapshot
    skeleton: Any
    share: Share | None
    """Where a rank writes a share of the state (``GroupCluster.select``): this rank's own tensor
    index, the tensors every rank shares and the replica claim; None where the snapshot is the
    whole state (one process)."""
    versions: dict[str, str]
    started: float
    """``time.perf_counter()`` when the snapshot began."""


@dataclass(frozen=True)
class CommitResult:
    """What was committed: the step, this rank's bytes, the seconds from snapshot to commit."""

    step: int
    bytes: int
    seconds: float
    upload: bool
    """The checkpoint was handed to the tiers that follow commits (every rank decided the same)."""


@dataclass
class CommitReport:
    """Rank → 0, round 2: how this rank's data file went. Fixed-size fields but for one process's
    index and skeleton (``index``, ``state``), which only a world of one sends."""

    rank: int
    created: float
    ok: bool = False
    error: str | None = None
    file: str | None = None
    size: int = 0
    xxh3_64: str | None = None
    upload_idle: bool = False
    index: dict[str, Any] | None = None
    """One process: the manifest's tensor index of its one file."""
    state: Any = None
    """One process: the skeleton."""
    agree: str | None = None
    """Several ranks: the digest of what they must report the same (:func:`agreement_digest`)."""
    directory_leader: int | None = None
    """Several ranks: the lowest rank whose local directory is this rank's."""
    leader: bool | None = None
    """Several ranks: this rank commits its directory."""
    score: dict[str, Any] | None = None
    """Rank 0 only, with a retention that keeps the best: its capture's score, which the manifest records."""

    def to_wire(self) -> dict[str, Any]:
        """The report as sent: only the fields this kind of report carries."""
        wire: dict[str, Any] = {"rank": self.rank, "created": self.created, "ok": self.ok}
        if not self.ok:
            wire["error"] = self.error
        else:
            wire.update(file=self.file, size=self.size, xxh3_64=self.xxh3_64, upload_idle=self.upload_idle)
            if self.index is not None:
                wire.update(index=self.index, state=self.state)
            else:
                wire.update(agree=self.agree, directory=self.directory_leader)
        if self.leader is not None:
            wire["leader"] = self.leader
        if self.score is not None:
            wire["score"] = self.score
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> CommitReport:
        return cls(
            rank=wire["rank"],
            created=wire["created"],
            ok=wire["ok"],
            error=wire.get("error"),
            file=wire.get("file"),
            size=wire.get("size", 0),
            xxh3_64=wire.get("xxh3_64"),
            upload_idle=wire.get("upload_idle", False),
            index=wire.get("index"),
            state=wire.get("state"),
            agree=wire.get("agree"),
            directory_leader=wire.get("directory"),
            leader=wire.get("leader"),
            score=wire.get("score"),
        )


@dataclass
class Verdict:
    """0 → every rank, round 2: the ranks' errors, or the replicated state differs, or (committable)
    whether every rank's uploader was idle and whether the ranks commit into several directories."""

    errors: list[str] = field(default_factory=list)
    mismatch: bool = False
    upload: bool = False
    several: bool = False
    """Node-local directories: their leaders tell each other what they read back damaged."""

    def to_wire(self) -> dict[str, Any]:
        if self.errors:
            return {"errors": self.errors}
        if self.mismatch:
            return {"mismatch": True}
        return {"upload": self.upload, "several": True} if self.several else {"upload": self.upload}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Verdict:
        return cls(
            list(wire.get("errors", [])),
            bool(wire.get("mismatch")),
            bool(wire.get("upload")),
            bool(wire.get("several")),
        )


@dataclass
class CommitReports:
    """0 → the leader of another local directory, round 2: every rank's report, in rank order, to
    write the same manifest."""

    reports: list[CommitReport]

    def to_wire(self) -> JSON:
        return [r.to_wire() for r in self.reports]

    @classmethod
    def from_wire(cls, wire: JSON) -> CommitReports:
        return cls([CommitReport.from_wire(r) for r in wire])


@dataclass
class Claims:
    """Rank → every rank, round 2, only when the ranks' agreement digests differ: what this rank
    claims in full, to name what differs: its replicated state and its sharded tensors' entries."""

    replicas: ReplicaClaim
    sharded: dict[str, TensorRecord]

    def to_wire(self) -> JSON:
        return {"replicas": self.replicas, "sharded": self.sharded}

    @classmethod
    def from_wire(cls, wire: JSON) -> Claims:
        return cls(wire["replicas"], wire["sharded"])


@dataclass
class DamagedSteps:
    """Each directory's leader → 0, then 0 → every rank, after a commit: the checkpoints it read back and
    set aside as damaged (the other ranks send none); then every leader's, which each leader sets aside."""

    steps: list[int]

    def to_wire(self) -> JSON:
        return self.steps

    @classmethod
    def from_wire(cls, wire: JSON) -> DamagedSteps:
        return cls([int(step) for step in wire])


class Committer:
    """Runs the commit protocol for one store (see the module docstring).

    Args:
        store: where checkpoints are committed (a local directory, or an object store).
        peers: the ranks committing together (their commit group).
        leader: this rank prepares and commits its directory (others share it).
        token: names this job's staging locations (agreed by every rank at start).
        directory_leader: the lowest rank whose local directory is this rank's (recorded in the manifest, so
            that a node-local directory's checkpoints can be checked from that directory alone).
        retainer: retention of ``store``, run after each commit.
        followers: the tiers that copy committed checkpoints (the remote tier): a committed checkpoint
            is handed to them if every rank's were ready when the ranks reported.
    """

    def __init__(
        self,
        store: Store,
        peers: Peers,
        *,
        leader: bool,
        token: str,
        retainer: Retainer,
        followers: Sequence[CommitFollower] = (),
        directory_leader: int = 0,
    ) -> None:
        self.store, self.peers, self.leader, self.token = store, peers, leader, token
        self.directory_leader = directory_leader
        self.retainer = retainer
        self._followers = list(followers)

    def run(self, job: CommitJob) -> CommitResult:
        try:
            with during(self.peers, f"the commit of step {job.step}"):
                return self._run(job)
        finally:
            job.pending.copied.set()  # a fence never waits on a failed persist

    def _run(self, job: CommitJob) -> CommitResult:
        rank, step = self.peers.rank, job.step
        copy_error: Exception | None = None
        try:  # first, so the fence shares the copies with this thread while the rounds wait on the others
            job.pending.finish_copy()
            if job.share is not None:  # the claim's pieces on a device, hashed from their copies here
                replicas.resolve(job.share["replicas"], job.pending.aside)
        except Exception as e:  # noqa: BLE001 - reported in round 2: every rank takes part in every round
            copy_error = e
        staging = self._prepare(step)
        name = data_file_name(rank)
        report = CommitReport(rank, time.time(), score=score_entry(job.skeleton) if rank == 0 else None)
        size = 0
        failure: Exception | None = None  # this rank's own, raised as the cause
        try:
            if copy_error is not None:
                raise copy_error
            record = None if job.share is None else {"state": job.skeleton, "tensors": job.share["rank"]}
            header = encode_header(job.pending.layout, record)
            size, digest = write_data(self.store, staging, name, header, job.pending.buffer)
            report.ok, report.file, report.size, report.xxh3_64 = True, name, size, digest
            report.upload_idle = bool(self._followers) and all(tier.ready for tier in self._followers)
            if job.share is None:  # one process: the manifest indexes the one file
                report.index, report.state = tensor_entries(job.pending.layout, name), job.skeleton
            else:
                report.agree, report.directory_leader = agreement_digest(job.share), self.directory_leader
        except Exception as e:  # noqa: BLE001 - every rank hears it, then it is raised here
            failure = e
            report.ok, report.error = False, f"rank {rank}: {type(e).__name__}: {e}"
        if job.share is not None:
            report.leader = self.leader
        reports = gather_messages(self.peers, report, CommitReport.from_wire)
        verdict = broadcast_message(
            self.peers, None if reports is None else judge(reports, job.share), Verdict.from_wire
        )
        problem = _problem(verdict, self.peers, job.share)
        if problem is not None:
            if self.leader:
                self.store.discard(staging)
            kind = ReplicaMismatchError if isinstance(problem, ReplicaMismatchError) else PersistError
            raise kind(f"checkpoint {step} not committed: {problem}") from failure
        reports = self._share_reports(reports, leader=self.leader)
        error: str | None = None
        if self.leader:
            try:
                assert reports is not None  # a leader has every rank's report, from rank 0 or its own gather
                manifest = merge(reports, step, job.epoch, job.versions, job.share)
                write_manifest(self.store, staging, manifest)
                self.store.commit(staging, step)
            except Exception as e:  # noqa: BLE001 - every rank hears it
                failure = e
                self.store.discard(staging)
                error = f"rank {rank}: {type(e).__name__}: {e}"
        failed = collect_errors(self.peers, error)
        if failed:
            raise PersistError(f"checkpoint {step} not committed: {'; '.join(failed)}") from failure
        seconds = time.perf_counter() - job.started
        upload = bool(self._followers) and verdict.upload
        if upload:
            for tier in self._followers:
                tier.follow(step, self.store)
        self._read_back(step, several=verdict.several)
        self.retainer.run(protect=step)
        return CommitResult(step, size, seconds, upload)

    def _read_back(self, step: int, *, several: bool) -> None:
        """Each directory's leader reads back the checkpoints that hold a slot before retention deletes
        one in their favour (:meth:`Retainer.check`). Several directories (node-local): the steps any
        leader found damaged are set aside by every leader that lists them, and again until no leader
        finds more; a leader's error is raised once every rank is through the rounds."""
        error: Exception | None = None
        damaged: list[int] = []
        while True:
            found: list[int] = []
            if error is None:
                try:
                    found = self.retainer.check(protect=step, damaged=damaged, fresh=not damaged)
                except Exception as e:  # noqa: BLE001 - raised once the other ranks are not waiting on this one
                    error = e
            if not several:
                break
            gathered = gather_messages(self.peers, DamagedSteps(found), DamagedSteps.from_wire)
            union = None if gathered is None else DamagedSteps(sorted({s for g in gathered for s in g.steps}))
            damaged = broadcast_message(self.peers, union, DamagedSteps.from_wire).steps
            if not damaged:
                break
        if error is not None:
            raise error

    def _share_reports(self, reports: list[CommitReport] | None, *, leader: bool) -> list[CommitReport] | None:
        """Rank 0 sends the reports to every other directory leader (node-local directories), which
        write the same manifest; the other ranks receive nothing."""
        if reports is not None:
            for other in (r.rank for r in reports if r.leader and r.rank != 0):
                send_message(self.peers, CommitReports(reports), other)
            return reports
        return receive_message(self.peers, 0, CommitReports.from_wire).reports if leader else None

    def _prepare(self, step: int) -> Any:
        """Round 1: each directory's leader creates the staging location; every rank learns it is ready."""
        staging, failure, error = None, None, None
        if self.leader:
            try:
                staging = self.store.staging_dir(step, self.token)
            except Exception as e:  # noqa: BLE001 - every rank hears it
                failure = e
                error = f"rank {self.peers.rank}: {type(e).__name__}: {e}"
        failed = collect_errors(self.peers, error)
        if failed:
            raise PersistError(f"checkpoint {step} not committed: {'; '.join(failed)}") from failure
        return staging if staging is not None else self.store.staging_dir(step, self.token, create=False)


def agreement_digest(share: Share) -> str:
    """A digest of what every rank must report the same: the shared tensors and the replica claim.

    The replicated tensors' entries (every rank's pieces: O(T + N)) enter through the plan's own
    digest (``share["plan"]``, computed once per layout), so each checkpoint hashes O(T) bytes
    at any number of ranks.
    """
    shared = {name: entry for name, entry in share["shared"].items() if entry["kind"] != REPLICATED}
    doc = json.dumps(
        {"plan": share["plan"], "shared": shared, "replicas": share["replicas"]}, sort_keys=True, separators=(",", ":")
    )
    return xxhash.xxh3_64_hexdigest(doc.encode())


def judge(reports: list[CommitReport], share: Share | None) -> Verdict:
    """Rank 0's judgement of every rank's report, broadcast to every rank."""
    errors = [r.error or f"rank {r.rank} failed" for r in reports if not r.ok]
    if errors:
        return Verdict(errors=errors)
    if share is not None and len({r.agree for r in reports}) > 1:
        return Verdict(mismatch=True)
    several = share is not None and len({r.directory_leader for r in reports}) > 1
    return Verdict(upload=all(r.upload_idle for r in reports), several=several)


def _problem(verdict: Verdict, peers: Peers, share: Share | None) -> Exception | None:
    """Why the checkpoint cannot be committed (the same answer on every rank), or None.

    Only when the ranks' digests differ do they exchange their claims in full, to name what differs.
    """
    if verdict.errors:
        return PersistError("; ".join(verdict.errors))
    if not verdict.mismatch:
        return None
    assert share is not None  # a world of one has nothing to disagree with
    sharded = {n: e for n, e in share["shared"].items() if e["kind"] == SHARDED}
    claims = all_gather_messages(peers, Claims(share["replicas"], sharded), Claims.from_wire)
    problem = replicas.disagreement([c.replicas for c in claims]) or replicas.sharded_disagreement(
        [c.sharded for c in claims]
    )
    return ReplicaMismatchError(problem or "ranks disagree on how the state stored once is split over them")


def merge(
    reports: list[CommitReport], step: int, epoch: int | None, versions: dict[str, str], share: Share | None
) -> Manifest:
    """The manifest: every rank's file, rank 0's score, and (one process) the file's index and skeleton or
    (several ranks) the tensors they share, from this rank's ``share`` (every rank reported the same)."""
    reports = sorted(reports, key=lambda r: r.rank)
    score = reports[0].score if reports[0].rank == 0 else None
    files: dict[str, FileEntry] = {}
    for r in reports:
        assert r.file is not None and r.xxh3_64 is not None  # merged only when every rank wrote its file
        files[r.file] = FileEntry(size=r.size, xxh3_64=r.xxh3_64)
    created = max(r.created for r in reports)
    if share is None:
        (report,) = reports
        return Manifest(
            step=step,
            epoch=epoch,
            world_size=1,
            files=files,
            tensors=report.index or {},
            state=report.state,
            versions=versions,
            created=created,
            score=score,
        )
    return Manifest(
        step=step,
        epoch=epoch,
        world_size=len(reports),
        files=files,
        tensors={},
        state=None,
        versions=versions,
        created=created,
        distributed={"tensors": share["shared"], "directories": [r.directory_leader for r in reports]},
        score=score,
    )
