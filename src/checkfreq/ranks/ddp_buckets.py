"""DistributedDataParallel's rebuilt gradient buckets, recorded at a checkpoint and given back to a resumed DDP.

DDP sums gradients in flat buckets, and after its first iteration rebuilds them in the order the
gradients became ready (rank 0's order, broadcast). At three ranks or more, where a gradient lies in
its bucket decides in which order an all-reduce adds the ranks' values, so a resumed DDP, which
starts with its initial buckets, would round its first iteration differently from the uninterrupted
run (:mod:`checkfreq.ranks.ddp_order`). :class:`BucketLayouts` records the rebuilt buckets at each
capture and, after a restore, gives a resumed DDP a reducer with those buckets from its first
iteration on; its own rebuild after that iteration then lands on the same buckets, as the gradients
become ready in the same order (checked at the next captures).

Left as they are: a DDP with a communication hook (it may keep state per bucket, and the hook is
registered on the reducer), one with ``find_unused_parameters=True`` (it never rebuilds: its
initial buckets, made by size, stay, so a resumed run reduces alike already), and one with
``static_graph=True`` (its first iteration delays every all-reduce to learn which parameters go
unused, and it rebuilds after its second iteration, also from those: another sequence than this
module replays).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from typing import Any

from torch import nn

from checkfreq.ranks import compat
from checkfreq.ranks.ddp_order import ddp_wrappers_by_name

log = logging.getLogger("checkfreq")

DDP = nn.parallel.DistributedDataParallel
Layout = list[list[int]]
"""A DDP's buckets, in the order they are reduced: each a list of parameter indices (the order of
``DDP.parameters()`` less the ignored and the frozen ones), in their order in the bucket."""


class BucketLayouts:
    """The buckets of the DDPs that are, or wrap at any depth, the registered ``modules``, at ``world_size`` ranks.

    Below three ranks the order of a sum of two ranks' values does not matter: nothing is recorded
    or replayed. The DDPs are looked for once (a pass over the garbage collector's objects), at
    the first :meth:`record` or :meth:`replay`, and held by weak references; objects that are not
    modules are ignored. A name wrapped by several live DDPs is left alone.
    """

    def __init__(self, modules: Mapping[str, object], world_size: int) -> None:
        self._modules = {name: weakref.ref(m) for name, m in modules.items() if isinstance(m, nn.Module)}
        self._world_size = world_size
        self._found: dict[str, list[weakref.ref[DDP]]] | None = None
        self._replayed: weakref.WeakKeyDictionary[DDP, Layout] = weakref.WeakKeyDictionary()
        """The layout each replayed DDP was given, until its logger reports the rebuild that followed."""

    def record(self) -> dict[str, Layout]:
        """For each registered name whose DDP has rebuilt its buckets, those buckets (JSON-able).

        The same on every rank: DDP's logger reports the buckets rank 0 chose and broadcast (asked to
        as soon as DDP rebuilt them, at its second forward); a DDP that :meth:`replay` gave buckets
        records those until its logger reports, and one that has not rebuilt yet (its first step) nothing.
        """
        recorded: dict[str, Layout] = {}
        for name, ddp in self._ddps().items():
            if _left_alone(ddp) is None:
                layout = self._layout(name, ddp)
                if layout is not None:
                    recorded[name] = layout
        return recorded

    def replay(self, recorded: Mapping[str, Any]) -> None:
        """Give each DDP whose name has a layout in ``recorded`` (what :meth:`record` returned at
        the checkpoint) a new reducer with those buckets, before its first forward after a restore.

        Every rank must be given the same ``recorded`` (what each rank recorded is). A layout that
        is not a partition of the DDP's parameter indices is refused with a warning.
        """
        names: dict[int, list[str]] = {}
        ddps: dict[int, DDP] = {}
        for name, ddp in sorted(self._ddps().items()):
            names.setdefault(id(ddp), []).append(name)
            ddps[id(ddp)] = ddp
        for key, ddp in ddps.items():
            reason = _left_alone(ddp)
            chosen = next((n for n in names[key] if n in recorded), None)
            if reason is not None:
                log.info("DDP of %r has %s: its gradient buckets are left as they are", names[key][0], reason)
            elif chosen is None:
                log.info(
                    "no gradient buckets were recorded for the DDP of %r (a checkpoint of its first "
                    "iteration, or of an older checkfreq): it starts with its initial buckets",
                    names[key][0],
                )
            else:
                self._replay(chosen, ddp, recorded[chosen])

    def _replay(self, name: str, ddp: DDP, recorded: Any) -> None:
        count = int(compat.ddp_logging_data(ddp).get("num_parameter_tensors", -1))
        layout = _checked(recorded, count)
        if layout is None:
            log.warning(
                "the gradient buckets recorded for the DDP of %r are not a partition of its %d parameters' "
                "indices (another model?): DDP starts with its initial buckets, and the resumed run's first "
                "iteration may round differently from the uninterrupted run",
                name,
                count,
            )
            return
        try:
            compat.rebuild_ddp_reducer(ddp, layout)
        except Exception as e:  # the restore goes on; only the last bits of one iteration are at stake
            log.warning(
                "could not give the DDP of %r its recorded gradient buckets (%s: %s): it starts with its "
                "initial buckets",
                name,
                type(e).__name__,
                e,
            )
            return
        self._replayed[ddp] = layout
        log.info(
            "DDP of %r reduces with the %d gradient buckets recorded at the checkpoint from its first iteration on",
            name,
            len(layout),
        )

    def _ddps(self) -> dict[str, DDP]:
        """The live DDP of each registered name wrapped by exactly one (none below three ranks)."""
        if self._world_size < 3:
            return {}
        if self._found is None:
            live = {name: m for name, ref in self._modules.items() if (m := ref()) is not None}
            self._found = {name: [weakref.ref(d) for d in ddps] for name, ddps in ddp_wrappers_by_name(live).items()}
            for name, refs in self._found.items():
                if len(refs) > 1:
                    log.info("%d DDPs wrap %r: checkfreq leaves their gradient buckets as they are", len(refs), name)
        found = {name: [d for ref in refs if (d := ref()) is not None] for name, refs in self._found.items()}
        return {name: ddps[0] for name, ddps in found.items() if len(ddps) == 1}

    def _layout(self, name: str, ddp: DDP) -> Layout | None:
        """The buckets ``ddp`` reduces with from now on, once known on every rank alike."""
        reported = _reported(compat.ddp_logging_data(ddp))
        replayed = self._replayed.get(ddp)
        if reported is None:
            return replayed
        if replayed is not None:
            del self._replayed[ddp]
            if reported != replayed:
                log.warning(
                    "DDP of %r rebuilt its gradient buckets after the restore to others than those recorded "
                    "at the checkpoint (its gradients became ready in another order): the resumed run rounds "
                    "differently from the uninterrupted one from there on",
                    name,
                )
        return reported


def _left_alone(ddp: DDP) -> str | None:
    """Why ``ddp``'s buckets are not recorded nor replayed, or None."""
    if compat.ddp_without_reducer(ddp):
        return "no bucketed reducer"
    if ddp.static_graph:
        return "static_graph=True"
    if ddp.find_unused_parameters:
        return "find_unused_parameters=True (it never rebuilds its buckets)"
    hook = compat.ddp_logging_data(ddp).get("comm_hook")
    return f"a communication hook ({hook})" if hook else None


def _reported(data: Mapping[str, Any]) -> Layout | None:
    """The rebuilt buckets in DDP's logging data (``"1 0 5, 4 3 2"``), or None before it reports them."""
    if data.get("has_rebuilt_buckets") != 1 or not data.get("rebuilt_per_bucket_param_indices"):
        return None
    return [[int(i) for i in bucket.split()] for bucket in str(data["rebuilt_per_bucket_param_indices"]).split(",")]


def _checked(layout: Any, count: int) -> Layout | None:
    """``layout`` if it is a list of non-empty lists of ints that hold each of ``range(count)`` once."""
    if not isinstance(layout, list) or not all(isinstance(b, list) and b for b in layout):
        return None
    flat = [i for bucket in layout for i in bucket]
    if not all(type(i) is int for i in flat) or sorted(flat) != list(range(count)):
        return None
    return [list(bucket) for bucket in layout]
