"""Phase 2's commit protocol: the same code for one process and for N ranks.

A checkpoint is committed in three rounds of small messages between the ranks (a world of one
passes them to itself, :class:`~checkfreq.dist.collectives.Solo`):

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

The job is a value (:class:`CommitJob`) and the answer too (:class:`CommitResult`): the writer
thread runs :meth:`Committer.run` and the training thread applies its result.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from checkfreq.dist import replicas
from checkfreq.dist.collectives import Peers, collect_errors, receive_json, send_json
from checkfreq.dist.shares import REPLICATED, SHARDED
from checkfreq.errors import PersistError, ReplicaMismatchError
from checkfreq.pipeline.retainer import Retainer
from checkfreq.pipeline.snapshot import PendingSnapshot
from checkfreq.storage.base import Store, write_data, write_manifest
from checkfreq.storage.format import Manifest, data_file_name, encode_header, tensor_entries

if TYPE_CHECKING:
    from checkfreq.pipeline.upload import Uploader

log = logging.getLogger("checkfreq.commit")


@dataclass(frozen=True)
class CommitJob:
    """What to write: one snapshot of this rank, taken at ``step``."""

    step: int
    epoch: int | None
    pending: PendingSnapshot
    skeleton: Any
    share: dict[str, Any] | None
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
    """The checkpoint was handed to the uploader (every rank decided the same)."""


class Committer:
    """Runs the commit protocol for one store (see the module docstring).

    Args:
        store: where checkpoints are committed (a local directory, or an object store).
        peers: the ranks committing together (their commit group).
        leader: this rank prepares and commits its directory (others share it).
        token: names this job's staging locations (agreed by every rank at start).
        directory: the lowest rank whose local directory is this rank's (recorded in the manifest, so
            that a node-local directory's checkpoints can be checked from that directory alone).
        retainer: retention of ``store``, run after each commit.
        uploader: with a remote tier, this rank's uploader: a committed checkpoint is handed to it
            if every rank's uploader was idle when the ranks reported.
    """

    def __init__(
        self, store: Store, peers: Peers, *, leader: bool, token: str, retainer: Retainer, uploader: Uploader | None = None,
        directory: int = 0,
    ) -> None:
        self.store, self.peers, self.leader, self.token, self.directory = store, peers, leader, token, directory
        self.retainer = retainer
        self._uploader = uploader

    def run(self, job: CommitJob) -> CommitResult:
        try:
            return self._run(job)
        finally:
            job.pending.copied.set()  # a fence never waits on a failed persist

    def _run(self, job: CommitJob) -> CommitResult:
        rank, step = self.peers.rank, job.step
        copy_error: Exception | None = None
        try:  # first, so the fence shares the copies with this thread while the rounds wait on the others
            job.pending.finish_copy()
        except Exception as e:  # noqa: BLE001 - reported in round 2: every rank takes part in every round
            copy_error = e
        staging = self._prepare(step)
        name = data_file_name(rank)
        report: dict[str, Any] = {"rank": rank, "created": time.time()}
        size = 0
        failure: Exception | None = None  # this rank's own, raised as the cause
        try:
            if copy_error is not None:
                raise copy_error
            record = None if job.share is None else {"state": job.skeleton, "tensors": job.share["rank"]}
            header = encode_header(job.pending.layout, record)
            size, digest = write_data(self.store, staging, name, header, job.pending.buffer)
            report.update(ok=True, file=name, size=size, xxh3_64=digest, upload_idle=self._uploader is not None and self._uploader.idle)
            if job.share is None:  # one process: the manifest indexes the one file
                report.update(index=tensor_entries(job.pending.layout, name), state=job.skeleton)
            else:
                report.update(agree=agreement_digest(job.share), directory=self.directory)
        except Exception as e:  # noqa: BLE001 - every rank hears it, then it is raised here
            failure = e
            report.update(ok=False, error=f"rank {rank}: {type(e).__name__}: {e}")
        if job.share is not None:
            report["leader"] = self.leader
        reports = self.peers.gather(report)
        verdict = self.peers.broadcast(None if reports is None else _verdict(reports, job.share))
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
        upload = self._uploader is not None and verdict["upload"]
        if upload:
            self._uploader.start(step)  # type: ignore[union-attr]
        self.retainer.run(protect=step)
        return CommitResult(step, size, seconds, upload)

    def _share_reports(self, reports: list[dict[str, Any]] | None, *, leader: bool) -> list[dict[str, Any]] | None:
        """Rank 0 sends the reports to every other directory leader (node-local directories), which
        write the same manifest; the other ranks receive nothing."""
        if reports is not None:
            for other in (r["rank"] for r in reports if r.get("leader") and r["rank"] != 0):
                send_json(self.peers, reports, other)
            return reports
        return receive_json(self.peers, 0) if leader else None

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


def agreement_digest(share: dict[str, Any]) -> str:
    """A digest of what every rank must report the same: the shared tensors and the replica claim.

    The replicated tensors' entries (every rank's pieces: O(T + N)) enter through the plan's own
    digest (``share["plan"]``, computed once per layout), so each checkpoint hashes O(T) bytes
    at any number of ranks.
    """
    shared = {name: entry for name, entry in share["shared"].items() if entry["kind"] != REPLICATED}
    doc = json.dumps({"plan": share["plan"], "shared": shared, "replicas": share["replicas"]}, sort_keys=True,
                     separators=(",", ":"))
    return xxhash.xxh3_64_hexdigest(doc.encode())


def _verdict(reports: list[dict[str, Any]], share: dict[str, Any] | None) -> dict[str, Any]:
    """Rank 0's judgement of every rank's report, broadcast to every rank: the ranks' errors, or
    whether the replicated state differs, or (committable) whether every uploader was idle."""
    errors = [r["error"] for r in reports if not r.get("ok")]
    if errors:
        return {"errors": errors}
    if share is not None and len({r["agree"] for r in reports}) > 1:
        return {"mismatch": True}
    return {"upload": all(r["upload_idle"] for r in reports)}


def _problem(verdict: dict[str, Any], peers: Peers, share: dict[str, Any] | None) -> Exception | None:
    """Why the checkpoint cannot be committed (the same answer on every rank), or None.

    Only when the ranks' digests differ do they exchange their claims in full, to name what differs.
    """
    if "errors" in verdict:
        return PersistError("; ".join(verdict["errors"]))
    if not verdict.get("mismatch"):
        return None
    assert share is not None  # a world of one has nothing to disagree with
    sharded = {n: e for n, e in share["shared"].items() if e["kind"] == SHARDED}
    claims = peers.all_gather({"replicas": share["replicas"], "sharded": sharded})
    problem = replicas.disagreement([c["replicas"] for c in claims]) or replicas.sharded_disagreement(
        [c["sharded"] for c in claims])
    return ReplicaMismatchError(problem or "ranks disagree on how the state stored once is split over them")


def merge(
    reports: list[dict[str, Any]], step: int, epoch: int | None, versions: dict[str, str], share: dict[str, Any] | None
) -> Manifest:
    """The manifest: every rank's file, and (one process) the file's index and skeleton or (several
    ranks) the tensors they share, from this rank's ``share`` (every rank reported the same)."""
    reports = sorted(reports, key=lambda r: r["rank"])
    files = {r["file"]: {"size": r["size"], "xxh3_64": r["xxh3_64"]} for r in reports}
    created = max(r["created"] for r in reports)
    if share is None:
        (report,) = reports
        return Manifest(step=step, epoch=epoch, world_size=1, files=files, tensors=report["index"], state=report["state"],
                        versions=versions, created=created)
    return Manifest(step=step, epoch=epoch, world_size=len(reports), files=files, tensors={}, state=None,
                    versions=versions, created=created,
                    distributed={"tensors": share["shared"], "directories": [r["directory"] for r in reports]})
