"""Rank 0's side of the restore: which step to try, which memory snapshot wins, and for one checkpoint
who reads each data file from which tier, who reads a damaged copy next, and who gets which file
from whom. Pure functions of the ranks' messages: no I/O, no collectives.
"""

from __future__ import annotations

from collections import Counter

from checkfreq.pipeline.restore.messages import (
    ALL_FILES,
    Agenda,
    ExchangeOrder,
    FetchPlan,
    Holdings,
    MemoryChoice,
    MemoryReport,
    Order,
    ReadFrom,
    ReadOrder,
    Refusal,
)
from checkfreq.pipeline.tiers.roles import SnapshotKey
from checkfreq.storage.format import Manifest, data_file_name


def memory_choice(reports: list[MemoryReport]) -> MemoryChoice:
    """The memory snapshot to restore: the newest every rank holds, of the same step and course,
    unless disk lists a newer step (or None); and whether every rank holds some snapshot. A step the
    ranks hold of different courses is not one state: never chosen."""
    common = set.intersection(*(set(r.steps) for r in reports))
    disk = max((r.disk for r in reports if r.disk is not None), default=None)
    best = max(common, default=None)
    if best is not None and disk is not None and best[0] < disk:
        best = None
    return MemoryChoice(best, bool(common))


def fetch_plan(reports: list[MemoryReport], unusable: frozenset[tuple[int, int, int]] = frozenset()) -> FetchPlan:
    """The newest memory snapshot (step and course) every rank holds itself or can take from a copy
    another rank keeps (not older than the newest step on disk), when some rank must take it from a
    copy: each such rank with every rank keeping its copy, in rank order (the first tried first, the
    next if it fails). Nothing to take (``step`` None) when every rank holds that snapshot itself, or
    none can be had by all. A copy of another course than the snapshot's is never taken (a course the
    run left). A copy in ``unusable`` (rank, step, keeper: one that could not be taken over) is
    passed over: the other keepers of that copy, else an older step."""
    disk = max((r.disk for r in reports if r.disk is not None), default=None)
    keepers: dict[tuple[int, SnapshotKey], list[int]] = {}  # (rank, snapshot) -> the ranks keeping its copy
    for keeper, report in enumerate(reports):
        for rank, held in report.copies.items():
            for key in held:
                if rank != keeper and (rank, key[0], keeper) not in unusable:
                    keepers.setdefault((rank, key), []).append(keeper)
    keys = {key for r in reports for key in r.steps} | {key for _, key in keepers}
    for key in sorted(keys, reverse=True):
        if disk is not None and key[0] < disk:
            break
        lacking = [rank for rank, report in enumerate(reports) if key not in report.steps]
        if all((rank, key) in keepers for rank in lacking):
            pairs = [(rank, keeper) for rank in lacking for keeper in keepers[(rank, key)]]
            return FetchPlan(key[0], pairs, course=key[1]) if lacking else FetchPlan(None, [])
    return FetchPlan(None, [])


def agenda(lists: list[list[int]]) -> Agenda:
    """The agenda from every rank's listed steps: the steps every rank lists, newest first, and why
    each other step is passed over."""
    count = Counter(s for steps in lists for s in set(steps))
    passed = {}
    for s, n in count.items():
        if n < len(lists):
            first = next(r for r, steps in enumerate(lists) if s not in steps)
            passed[s] = f"{len(lists) - n} of {len(lists)} ranks list no such checkpoint (rank {first} first)"
    every = sorted((s for s, n in count.items() if n == len(lists)), reverse=True)
    return Agenda(every, passed, bool(count))


def assign_readers(names: list[str], views: list[Holdings]) -> tuple[dict[str, list[int]], dict[str, set[int]]]:
    """For each data file in ``names``: the ranks whose directory holds it (``views``: every rank's
    holdings), and the one of them that reads it from storage (the holders take turns over the
    files). A file no directory holds has no holder and no reader.

    O(N + the files the views list): the ranks that hold every file (a shared directory) are one
    list, shared by every file no other rank lists.
    """
    everyone = [r for r, view in enumerate(views) if view.held == ALL_FILES]
    some: dict[str, list[int]] = {}
    for r, view in enumerate(views):
        if view.held != ALL_FILES:
            for name in view.held or ():
                some.setdefault(name, []).append(r)
    holders = {name: sorted(everyone + some[name]) if name in some else everyone for name in names}
    return holders, {name: {held[i % len(held)]} for i, (name, held) in enumerate(holders.items()) if held}


def unreachable(manifest: Manifest, views: list[Holdings]) -> str | None:
    """Why no rank can get some data file (``views``: every rank's holdings), or None."""
    if any(view.held == ALL_FILES for view in views) or any(view.remote for view in views):
        return None  # a directory holds every file, or some rank reads what no directory holds from the remote tier
    held_by = {name for view in views for name in view.held or ()}
    missing = next((name for name in sorted(manifest.files) if name not in held_by), None)
    if missing is None:
        return None
    if len(views) == 1:
        return f"data file {missing} is missing"
    return f"data file {missing} is in no rank's directory, and no remote tier lists the checkpoint"


class ReadPlan:
    """Rank 0's plan for one checkpoint: who reads each data file from which tier, after a damaged
    copy who reads it next, and then who gets which file from whom.

    O(N + files) to make (but for what every rank gets whole, every file in the modes that give
    every rank every file); a rank's orders name the files it reads, maps, receives and sends.

    Args:
        manifest: the checkpoint's manifest (rank 0's copy; every rank read the same files' list).
        views: every rank's holdings, each with what its directory holds.
        streamable: the checkpoint's replicated tensors can be all-gathered as one stream.
        replicated: it holds replicated tensors at all.
    """

    def __init__(self, manifest: Manifest, views: list[Holdings], *, streamable: bool, replicated: bool) -> None:
        self.manifest, self.views = manifest, views
        self.names = sorted(manifest.files)
        self.holders, checked = assign_readers(self.names, views)
        self.reader = {name: next(iter(ranks)) for name, ranks in checked.items()}
        self.source = dict.fromkeys(self.reader, ReadFrom.DIRECTORY)
        self.tried = {name: {views[r].directory_leader for r in ranks} for name, ranks in checked.items()}
        self.remote_ranks = [r for r, view in enumerate(views) if view.remote]
        self.load = Counter(self.reader.values())
        self._to_remote([name for name in self.names if name not in self.reader])
        caches = {view.cache for view in views}
        one_cache = len(caches) == 1 and None not in caches and all(view.held == ALL_FILES for view in views)
        self.lean = not one_cache and streamable and all(view.needs is not None for view in views)
        """Each rank gets the files it needs whole and the replicated tensors all-gathered, not every file."""
        self.streamed = self.lean and replicated
        """The ranks all-gather the replicated tensors (a lean plan, and the checkpoint has some)."""
        self.fresh = set(self.names)
        """The files whose reader has not read them yet."""

    @classmethod
    def of(
        cls, manifest: Manifest | None, views: list[Holdings | str], *, streamable: bool, replicated: bool
    ) -> ReadPlan | str:
        """The plan, or why the ranks cannot restore this checkpoint (``manifest``: None where rank 0
        itself cannot read it)."""
        for rank, view in enumerate(views):
            if isinstance(view, str):
                return f"rank {rank} cannot read its manifest: {view}" if len(views) > 1 else view
        holdings = [view for view in views if isinstance(view, Holdings)]
        assert manifest is not None  # rank 0's own view is its holdings
        differs = next((r for r, view in enumerate(holdings) if view.files != holdings[0].files), None)
        if differs is not None:
            return f"rank {differs}'s manifest lists other data files than rank 0's"
        for view in holdings:
            if view.held is None:  # what its directory's leader found there
                view.held = holdings[view.directory_leader].held
        return unreachable(manifest, holdings) or cls(manifest, holdings, streamable=streamable, replicated=replicated)

    def _to_remote(self, names: list[str]) -> None:
        """Give each of ``names`` a reader of the remote tier, the least busy first."""
        ranks = sorted(self.remote_ranks, key=lambda r: (self.load[r], r))
        for i, name in enumerate(names):
            reader = ranks[i % len(ranks)]
            self.reader[name], self.source[name] = reader, ReadFrom.FAR
            self.load[reader] += 1

    def orders(self) -> list[Order]:
        """Every rank's next orders, in rank order."""
        reads: list[list[tuple[str, ReadFrom]]] = [[] for _ in self.views]
        for name in sorted(self.fresh):
            reads[self.reader[name]].append((name, self.source[name]))
        self.fresh = set()
        return [ReadOrder(read, self.streamed) for read in reads]

    def after(self, reports: list[dict[str, str]]) -> list[Order]:
        """The orders once every rank said which of its files were damaged and why (``reports``)."""
        to_remote = []
        for rank, damaged in enumerate(reports):
            for name, why in damaged.items():
                no_copy_left: list[Order] = [Refusal(f"rank {rank}: {why}" if len(reports) > 1 else why)] * len(reports)
                if self.source[name] == ReadFrom.FAR:
                    return no_copy_left
                if not self._next_holder(name):  # no other directory holds it: the remote tier, if listed
                    if not self.remote_ranks:
                        return no_copy_left
                    to_remote.append(name)
                self.fresh.add(name)
        self._to_remote(to_remote)
        return self.orders() if self.fresh else self._exchange_orders()

    def _next_holder(self, name: str) -> bool:
        """Give ``name`` to a holder in a directory not tried yet, if there is one."""
        for rank in self.holders[name]:
            if self.views[rank].directory_leader not in self.tried[name]:
                self.tried[name].add(self.views[rank].directory_leader)
                self.reader[name] = rank
                return True
        return False

    def _exchange_orders(self) -> list[Order]:
        """What each rank maps, receives and sends, in how many rounds it all-gathers the replicated
        pieces, and whether it gets only some files (``partial``)."""
        rounds = max(Counter(self.reader.values()).values()) if self.streamed else 0  # the most files a rank read
        orders = [ExchangeOrder([], [], [], rounds, self.lean) for _ in self.views]
        for rank, order in enumerate(orders):
            view = self.views[rank]
            needs = [data_file_name(k) for k in view.needs or ()] if self.lean else self.names
            held = set() if view.held in (None, ALL_FILES) else set(view.held)
            for name in needs:
                reader = self.reader[name]
                if reader == rank:
                    continue
                holds = view.held == ALL_FILES or name in held
                if (
                    holds
                    and self.source[name] == ReadFrom.DIRECTORY
                    and view.cache is not None
                    and view.cache == self.views[reader].cache
                ):
                    order.map.append(name)
                else:
                    order.receive.append((name, reader))
                    orders[reader].send.append((name, rank))
        return list(orders)
