"""The restore protocol every rank runs (see the package docstring): the ranks agree on a checkpoint,
read it as rank 0 orders, and exchange what each needs."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from checkfreq.errors import CheckfreqError, CorruptCheckpointError, InvalidArgumentError, NoValidCheckpointError
from checkfreq.pipeline.restore.advice import no_valid_checkpoint
from checkfreq.pipeline.restore.copies import fetch_copies
from checkfreq.pipeline.restore.course import draw_course, next_course
from checkfreq.pipeline.restore.messages import (
    Agenda,
    CheckpointView,
    DamageReport,
    ExchangeOrder,
    ExchangeOutcome,
    ExchangeVerdict,
    FileTransfer,
    Holdings,
    ListedSteps,
    MemoryChoice,
    MemoryReport,
    NewestStep,
    Order,
    ReadFrom,
    ReadOrder,
    Refusal,
    decode_order,
)
from checkfreq.pipeline.restore.plan import ReadPlan, agenda, memory_choice
from checkfreq.pipeline.restore.progress import logged_reads
from checkfreq.pipeline.restore.read import Files, stored_views
from checkfreq.pipeline.restore.readable import Blocks, Readable
from checkfreq.pipeline.retention.best import best_step
from checkfreq.pipeline.tiers.chosen import Tiers
from checkfreq.pipeline.tiers.roles import CheckpointSource
from checkfreq.policies.retention import Retention
from checkfreq.ranks.collectives import (
    Peers,
    broadcast_message,
    collect_errors,
    during,
    gather_messages,
    receive_message,
    scatter_messages,
    send_message,
)
from checkfreq.ranks.rebuild import uncovered
from checkfreq.storage.format import FileEntry, Manifest, checkpoint_name
from checkfreq.storage.local import LocalStore

log = logging.getLogger("checkfreq.restore")

Skipped = list[tuple[str, str]]
"""(checkpoint or memory slot, why it was not restored)."""
FROM_PEERS = "peer"
"""Where data came from when other ranks sent it (not a tier)."""


@dataclass
class Found:
    """A checkpoint read for restore."""

    manifest: Manifest
    tensors: dict[str, torch.Tensor]
    name: str
    tier: str
    """Where this rank's data came from: tier names (:class:`~checkfreq.pipeline.tiers.roles.TierName`) and
    :data:`FROM_PEERS` (other ranks sent it), joined with ``+`` (``"local+peer"``), or ``"memory"``."""
    held: bool
    """A whole state a tier holds (:class:`~checkfreq.pipeline.tiers.roles.StateKeeper`), applied as it was
    kept and not on disk; else a checkpoint's files, cut for this rank at any saved world size."""
    elsewhere: bool
    """Read, in part or whole, from somewhere else than the checkpoint directory (messages say where)."""
    skipped: Skipped = field(default_factory=list)


class Restorer:
    """Finds and reads the checkpoint to restore, agreed by every rank.

    Args:
        tiers: this rank's tiers: those holding whole states (the memory tier) are asked first, then
            the directory checkpoints are committed to, then the far tiers (the remote tier).
        peers: the ranks restoring together.
        page_cache: ranks passing the same value read their directory through one page cache (a
            directory on a machine-local file system that they share: the lowest rank sharing it);
            None where each rank's reads go to storage (a network file system, an object store).
        directory_leader: ranks passing the same value share one local directory (its lowest rank; the
            default: this rank's own).
    """

    def __init__(
        self,
        tiers: Tiers,
        peers: Peers,
        page_cache: int | None = None,
        directory_leader: int | None = None,
        retention: Retention | None = None,
    ) -> None:
        self.tiers, self.peers = tiers, peers
        self.retention = Retention(1) if retention is None else retention
        self.local = tiers.store
        self._stored: dict[str, CheckpointSource] = {tier.name: tier for tier in [tiers.committed_to, *tiers.far]}
        self.page_cache = page_cache
        self.directory_leader = peers.rank if directory_leader is None else directory_leader
        self._locations: dict[str, dict[int, Any]] = {}
        self._blocks: Blocks | None = None
        self._first_course, self._restores = 0, 0  # the course drawn at start-up, and the restores since

    def listed(self) -> list[int]:
        """Steps of the committed checkpoints either tier lists, newest first (not verified)."""
        steps = {s for tier in self._stored.values() for s, _ in tier.checkpoints()}
        return sorted(steps, reverse=True)

    def newest_on_any_rank(self) -> int | None:
        """The newest step any rank's tiers list or hold (not verified), the same on every rank; the
        tiers take the course rank 0 draws for the session's snapshots. Collective."""
        mine = [s for s in [*self.listed()[:1], self.tiers.newest_step()] if s is not None]
        steps = gather_messages(self.peers, NewestStep(max(mine, default=None)), NewestStep.from_wire)
        newest = (
            None
            if steps is None
            else NewestStep(max((s.step for s in steps if s.step is not None), default=None), draw_course())
        )
        agreed = broadcast_message(self.peers, newest, NewestStep.from_wire)
        self._first_course = agreed.course
        self.tiers.begin_course(agreed.course)  # the session's snapshots are of a course of its own
        return agreed.step

    def find(
        self, step: int | str | None = None, blocks: Blocks | None = None, *, device_copies: bool = False
    ) -> Found | None:
        """The newest valid checkpoint (or the one at ``step``; ``"best"``: :func:`best_step`'s) every
        rank can read; None if no rank lists any; :class:`NoValidCheckpointError` if some exist but none is valid.

        ``blocks`` gives the blocks of the sharded tensors this rank restores: with it a rank gets
        only the files that hold them (its own, when the layout is the saved one); without it, every
        rank gets every file of a checkpoint with sharded tensors. With ``device_copies`` (the state
        is restored onto a GPU) memory slots are pinned before they are read, so the copies to the
        device run at the pinned bandwidth.
        """
        if isinstance(step, bool) or not (step is None or step == "best" or isinstance(step, int)):
            raise InvalidArgumentError(f"restore() takes step=None, a step number or 'best', got {step!r}")
        self._restores += 1
        self.tiers.begin_course(next_course(self._first_course, self._restores))  # what follows is another course
        with during(self.peers, "the restore"):
            if step == "best" and (step := best_step(self._stored.values(), self.peers, self.retention)) is None:
                return None
            assert not isinstance(step, str)  # "best" resolved above
            return self._find(step, blocks, device_copies)

    def _find(self, step: int | None, blocks: Blocks | None, device_copies: bool) -> Found | None:
        self._blocks = blocks
        listed = [s for s in self.listed() if step is None or s == step]
        if self.tiers.holds_states:
            found = self._from_memory(step, listed, device_copies)
            if found is not None:
                return found
        try:
            return self._from_disk(step, listed)
        except NoValidCheckpointError:
            if not self.tiers.holds_states:
                raise
            log.warning("no valid checkpoint on disk; trying older memory snapshots")
            found = self._from_memory(step, [], device_copies)
            if found is None:
                raise
            return found

    # ------------------------------------------------------------------ memory

    def _from_memory(self, step: int | None, listed: list[int], device_copies: bool = False) -> Found | None:
        """The newest memory snapshot every rank holds and can put together (:meth:`Tiers.complete`),
        unless disk lists a newer checkpoint: a step some rank cannot put together gives way to the
        next older one every rank holds."""
        if self.tiers.keeps_copies and step is None:  # a rank that lost its snapshots takes them from copies
            fetch_copies(self.tiers, self.peers, listed[0] if listed else None)
        states, skipped = self.tiers.snapshots(step, device_copies=device_copies)
        by_key = {(state.manifest.step, state.course): state for state in states}
        failed = ""  # logged with what follows
        while True:
            reports = gather_messages(
                self.peers, MemoryReport(sorted(by_key), listed[0] if listed else None), MemoryReport.from_wire
            )
            choice = None if reports is None else memory_choice(reports)
            best, common = (chosen := broadcast_message(self.peers, choice, MemoryChoice.from_wire)).best, chosen.common
            if failed:  # the shard, where its copy is kept, and the next source every rank goes to
                log.warning("%s; restoring %s instead", failed, "from disk" if best is None else f"snapshot {best[0]}")
            if best is None:
                if by_key and not common:
                    log.warning(
                        "memory tier: not every rank holds a valid snapshot of one step and course (a rank "
                        "absent from an earlier restore keeps those of the course the run left); restoring from disk"
                    )
                return None
            try:  # the shares other ranks keep (a rank that keeps its whole state needs none)
                held = by_key[best]
                state, problem = held.keeper.complete(held), None
            except CheckfreqError as e:
                problem = f"rank {self.peers.rank}: {e}"
            problems = collect_errors(self.peers, problem)
            if not problems:
                return Found(state.manifest, state.tensors, state.name, state.tier, True, True, skipped)
            failed = f"memory tier: snapshot {best[0]} cannot be put together ({'; '.join(problems)})"
            skipped.append((f"memory snapshot {best[0]}", "; ".join(problems)))
            del by_key[best]  # the same on every rank: the next round tries an older step, or disk

    # ------------------------------------------------------------------ disk

    def _from_disk(self, step: int | None, listed: list[int]) -> Found | None:
        self._locations = {name: dict(tier.checkpoints()) for name, tier in self._stored.items()}
        if isinstance(self.local, LocalStore) and self.directory_leader == self.peers.rank:
            for _, path, target in self.local.linked_checkpoints():
                log.warning(
                    "%s in %s is a symbolic link (to %s), not a checkpoint directory: never restored",
                    path.name,
                    self.local.root,
                    target,
                )
        lists = gather_messages(self.peers, ListedSteps(listed), ListedSteps.from_wire)
        plan = broadcast_message(
            self.peers, None if lists is None else agenda([s.steps for s in lists]), Agenda.from_wire
        )
        problems = dict(plan.passed)
        skipped: Skipped = []
        damaged: dict[int, str] = {}
        for s in plan.steps:  # the same steps on every rank, in the same order
            skipped += self._skip_newer_than(s, problems)
            found = self._restore_step(s)
            if isinstance(found, Found):
                found.skipped = skipped
                self._set_aside(damaged)
                return found
            problems[s] = damaged[s] = found
        skipped += self._skip_newer_than(-1, problems)
        if step is not None or plan.listed:
            raise no_valid_checkpoint(self.tiers, step, skipped, self.listed())
        aside = self.local.set_aside_checkpoints()  # every rank looks: each raises, or none does
        if aside:
            raise NoValidCheckpointError(
                f"{self.local.root} lists no checkpoint to restore, but holds {len(aside)} set aside "
                f"({', '.join(a.name for a in aside[:3])}): rather than start afresh over them, put one back by "
                'hand if its damage has passed (docs/storage.md, "Damaged checkpoints"), restore from another '
                "tier, or give the run a new directory"
            )
        return None

    def _set_aside(self, damaged: dict[int, str]) -> None:
        """Set aside, in this rank's directory if it leads it, the checkpoints every rank agreed are
        damaged (``damaged``: step → why), now that an older one restored.

        Each directory's leader moves only what its own directory lists, and only after the ranks
        agreed (the steps and reasons are the same on every rank), so no two ranks race and no rank
        acts on what only it saw. Nothing is set aside when no checkpoint restores: a directory whose
        every checkpoint fails to read (a storage outage) keeps them listed, and the next restore
        says so rather than starting afresh. Setting aside keeps the files, so a checkpoint that
        failed for a passing reason can be put back by hand; a failure to set aside is logged, never
        raised."""
        if self.directory_leader != self.peers.rank:
            return
        listed = self._locations[self.tiers.committed_to.name]
        for step, why in sorted(damaged.items(), reverse=True):
            if step in listed:
                try:
                    self.local.set_aside(listed[step], why)
                except Exception as e:  # noqa: BLE001 - the restore itself succeeded
                    log.warning("could not set aside damaged checkpoint %s: %s", checkpoint_name(step), e)

    @staticmethod
    def _skip_newer_than(step: int, problems: dict[int, str]) -> Skipped:
        """Log and take out the problems of the steps newer than ``step`` (those passed over to reach it)."""
        skipped = []
        for s in sorted((s for s in problems if s > step), reverse=True):
            why = problems.pop(s)
            log.warning("skipping checkpoint %s: %s", checkpoint_name(s), why)
            skipped.append((checkpoint_name(s), why))
        return skipped

    def _readable(self, step: int) -> Readable | str:
        """How this rank can read checkpoint ``step``, or why it cannot."""
        local = self._locations[self.tiers.committed_to.name].get(step)
        far = next((tier.name for tier in self.tiers.far if step in self._locations[tier.name]), None)
        manifest, problem = None, "no manifest"
        for name, tier in self._stored.items():
            location = self._locations[name].get(step)
            if location is None or manifest is not None:
                continue
            try:
                manifest = tier.read_manifest(location)
            except CorruptCheckpointError as e:
                problem = str(e)
        if manifest is None:
            return problem
        if self.directory_leader != self.peers.rank:
            held = None  # one rank of a directory looks: the others would repeat its N lookups
        else:
            held = (
                set()
                if local is None
                else {name for name in manifest.files if self.local.file_size(local, name) is not None}
            )
        return Readable(step, manifest, held, far)

    def _restore_step(self, step: int, own_shards: bool = True) -> Found | str:
        """Checkpoint ``step`` read, verified and shared as rank 0 plans it, or why it cannot be.

        Collective: every rank sends rank 0 its view of the checkpoint, then takes rank 0's orders (read these
        files; again after a damaged copy; then what to map, receive and send) until rank 0 says
        the step fails or the files are all verified. With ``own_shards``, a rank may get only the
        files of a checkpoint with sharded tensors that hold its blocks (:meth:`Readable.needs`); if
        their shards then do not cover them, on any rank, the ranks take the step again, each
        getting every file.
        """
        readable = self._readable(step)
        if isinstance(readable, str):
            view = CheckpointView(readable)
        else:
            needs = readable.needs(self.peers.rank, self.peers.size, self._blocks if own_shards else None)
            view = CheckpointView(readable.holdings(self.page_cache, self.directory_leader, needs))
        views = gather_messages(self.peers, view, CheckpointView.from_wire)
        plan: ReadPlan | str | None = None
        if views is not None:
            plan = _plan_of(readable, [v.view for v in views])
        if isinstance(plan, str):
            plan_orders: list[Order] | None = [Refusal(plan)] * self.peers.size
        else:
            plan_orders = None if plan is None else plan.orders()
        order = scatter_messages(self.peers, plan_orders, decode_order)
        files: Files = {}
        packs: dict[str, torch.Tensor] = {}
        tiers: set[str] = set()
        while isinstance(order, ReadOrder):
            assert isinstance(readable, Readable)
            damaged = self._read_assigned(readable, order, files, packs, tiers)
            reports = gather_messages(self.peers, DamageReport(damaged), DamageReport.from_wire)
            next_orders = None
            if reports is not None:
                assert isinstance(plan, ReadPlan)  # rank 0 planned, since it gave orders to read
                next_orders = plan.after([r.damaged for r in reports])
            order = scatter_messages(self.peers, next_orders, decode_order)
        if isinstance(order, Refusal):
            return order.problem
        assert isinstance(readable, Readable)
        problem: str | None = None
        found: Found | None = None
        short: str | None = None
        check = order.partial and readable.sharded  # the same on every rank
        try:
            found = self._exchange(readable, order, files, packs, tiers)
            if check:
                assert self._blocks is not None  # rank 0 plans a sharded checkpoint so only then
                short = next(iter(uncovered(found.manifest, self._blocks(readable.manifest))), None)
        except CorruptCheckpointError as e:
            problem = f"rank {self.peers.rank}: {e}" if self.peers.size > 1 else str(e)
        if not check:
            failed = collect_errors(self.peers, problem)
        else:
            failed, short_of = self._outcome(problem, short)
            if short_of is not None:
                if self.peers.rank == 0:
                    log.info(
                        "checkpoint %s: the data files rank %d got do not hold all of its block of %s (the "
                        "shards were laid out otherwise); every rank gets every file",
                        checkpoint_name(step),
                        *short_of,
                    )
                return self._restore_step(step, own_shards=False)
        if failed:
            return "; ".join(failed)
        assert found is not None  # no rank failed, this one included
        return found

    def _outcome(self, problem: str | None, short: str | None) -> tuple[list[str], tuple[int, str] | None]:
        """Every rank's error, and the first rank whose files fall short of its blocks with the
        tensor (``short``: this rank's first such, or None), the same on every rank: one gather and
        its broadcast, as :func:`~checkfreq.ranks.collectives.collect_errors`."""
        gathered = gather_messages(self.peers, ExchangeOutcome(problem, short), ExchangeOutcome.from_wire)
        verdict = None
        if gathered is not None:
            first = next(((rank, o.short) for rank, o in enumerate(gathered) if o.short is not None), None)
            verdict = ExchangeVerdict([o.problem for o in gathered if o.problem], first)
        answer = broadcast_message(self.peers, verdict, ExchangeVerdict.from_wire)
        return answer.errors, answer.short_of

    def _read_assigned(
        self, readable: Readable, order: ReadOrder, files: Files, packs: dict[str, torch.Tensor], tiers: set[str]
    ) -> dict[str, str]:
        """Read and verify the files ``order`` gives this rank (packing their replicated pieces if
        it says so); return why each damaged one is."""
        stream = readable.stream if order.pack else None
        damaged = {}
        total = sum(int(readable.manifest.files[name]["size"]) for name, _ in order.read)
        with logged_reads(readable.step, total):
            for name, where in order.read:
                source = self.tiers.committed_to.name if where == ReadFrom.DIRECTORY else readable.far
                try:
                    files[name] = self._read_file(source, readable.step, name, readable.manifest.files[name])
                    if stream is not None:
                        packs[name] = stream.row(name, *files[name])
                    tiers.add(str(source))
                except CorruptCheckpointError as e:
                    files.pop(name, None)
                    damaged[name] = str(e)
                    log.warning(
                        "checkpoint %s: %s copy of %s is damaged (%s)",
                        checkpoint_name(readable.step),
                        "this rank's" if where == ReadFrom.DIRECTORY else f"the {source}",
                        name,
                        e,
                    )
        return damaged

    def _exchange(
        self, readable: Readable, order: ExchangeOrder, files: Files, packs: dict[str, torch.Tensor], tiers: set[str]
    ) -> Found:
        """Send and receive the whole files ``order`` says, all-gather the replicated pieces if it
        says so, map the files a reader verified in the page cache this rank shares; then this
        rank's manifest and stored arrays."""
        step, manifest = readable.step, readable.manifest
        position = {name: i for i, name in enumerate(sorted(manifest.files))}
        me = self.peers.rank
        operations: list[tuple[int, int, str, int | None]] = sorted(
            [(position[name], to, name, None) for name, to in order.send]
            + [(position[name], me, name, sender) for name, sender in order.receive]
        )
        for _, to, name, sender in operations:  # one order on every rank: each pair meets in turn
            if sender is None:
                data, header = files[name]
                send_message(self.peers, FileTransfer(header, data.numel()), to)
                self.peers.send(data, to)
            else:
                sent = receive_message(self.peers, sender, FileTransfer.from_wire)
                files[name] = (self.peers.receive(sent.size, sender), sent.header)
                tiers.add(FROM_PEERS)
        replicated: dict[str, torch.Tensor] = {}
        if order.stream:
            stream = readable.stream
            assert stream is not None  # rank 0 streams only a checkpoint written by several ranks
            mine = [packs[name] for name in sorted(packs)]
            rows = torch.cat(
                [
                    self.peers.all_gather_rows(mine[r] if r < len(mine) else stream.empty_row())
                    for r in range(order.stream)
                ]
            )
            replicated = stream.tensors_of(rows)
            manifest = stream.whole(manifest)
            if len(packs) < len(manifest.files):
                tiers.add(FROM_PEERS)
        for name in order.map:
            files[name] = self._map_file(
                self._locations[self.tiers.committed_to.name].get(step), name, manifest.files[name]
            )
            tiers.add(self.tiers.committed_to.name)
        manifest, stored = stored_views(manifest, files, partial=order.partial)
        stored.update(replicated)
        order_of_sources = [self.tiers.committed_to.name, FROM_PEERS, *(tier.name for tier in self.tiers.far)]
        used = "+".join(t for t in order_of_sources if t in tiers) or self.tiers.committed_to.name
        return Found(manifest, stored, checkpoint_name(step), used, False, used != self.tiers.committed_to.name)

    def _map_file(self, location: Any, name: str, entry: FileEntry) -> tuple[torch.Tensor, dict[str, Any]]:
        """A file of this rank's directory that a rank sharing its page cache verified."""
        assert isinstance(self.local, LocalStore)  # only a local directory shares a page cache
        return self.local.map_data(location, name, entry["size"], entry["xxh3_64"])

    def _read_file(
        self, source: str | None, step: int, name: str, entry: FileEntry
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Data file ``name`` of checkpoint ``step`` from the tier named ``source`` (None: no far tier lists it)."""
        location = None if source is None else self._locations[source].get(step)
        if source is None or location is None:
            raise CorruptCheckpointError(f"the {source or 'remote'} tier no longer lists this checkpoint")
        return self._stored[source].read_data(location, name, entry["size"], entry["xxh3_64"])


def _plan_of(readable: Readable | str, views: list[Holdings | str]) -> ReadPlan | str:
    """Rank 0's plan for a checkpoint, or why the ranks cannot restore it."""
    if isinstance(readable, str):
        return ReadPlan.of(None, views, streamable=False, replicated=False)
    stream = readable.stream
    return ReadPlan.of(
        readable.manifest, views, streamable=stream is not None, replicated=stream is not None and bool(stream.tensors)
    )
