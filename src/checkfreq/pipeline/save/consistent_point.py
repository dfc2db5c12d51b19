"""Every checkpoint is captured at one kind of moment: its step's consistent point.

``ckpt.step()`` right after ``optimizer.step()`` only *decides* (the policy, a tier's cadence, a
trapped signal; ``log()`` of the ranked metric decides too). What the loop does next may still
belong to that step: a scheduler stepped after ``ckpt.step()``, an evaluation and its ``log()``, an
epoch-level scheduler, a value set. So the capture waits for the first moment at which the loop can
no longer change the step's state without starting the next step:

* the loop asks a registered :class:`~checkfreq.data.ResumableLoader` for a batch, a new pass, or
  moves it to an epoch (with gradients enabled: an evaluation under ``torch.no_grad()`` is not the
  next step);
* a registered module runs a training forward (gradients enabled, the module in training mode),
  before any of it runs: the forward of the next step draws dropout's random numbers and updates
  BatchNorm's buffers;
* a registered optimizer is about to step (before its update: the last resort of a loop whose
  forward and batches checkfreq does not see);
* ``save()``, ``wait()``, ``close()`` or the next ``ckpt.step()``, whichever comes first.

No optimizer step happens before the point, so the checkpoint carries the step's label. At a point
that no loader marks (a training forward, the next update), nothing tells where the next step's own
random draws began (a ``get_batch()`` drawing from the global generator before the forward, an
evaluation at the top of the loop): the generators are then taken as they were at the decision, and
everything else at the point. A loader
asked for its next batch *before* the optimizer step (a prefetching loop) hands that batch to the
next step: at a point reached by the next forward, a batch handed out since the previous training
forward is not counted as taken (:meth:`ResumableLoader.hold_back_handed_out`).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from checkfreq.data.loader import ResumableLoader
from checkfreq.pipeline.capture.registered import Registered
from checkfreq.pipeline.tiers.roles import SnapshotTaker
from checkfreq.ranks.collectives import Peers
from checkfreq.run.rng import RNGState

log = logging.getLogger("checkfreq")


@dataclass
class Pending:
    """What was decided at ``step`` and waits for the step's consistent point."""

    step: int
    checkpoint: bool
    """A checkpoint (else only ``tiers``' own snapshots, or a trapped signal's)."""
    tiers: tuple[SnapshotTaker, ...] = ()
    reasons: list[str] = field(default_factory=list)
    """Who decided a checkpoint: ``"policy"``, ``"log()"``, ``"retake"`` (a ``save()`` the state moved on from)."""
    rng: dict[str, Any] | None = None
    """The generators' states at the decision (the registered ``rng``'s), for a point no loader marks."""

    @property
    def reason(self) -> str:
        """The events' reason of its checkpoint."""
        return REASONS.get(tuple(self.reasons), "policy")


LOADER_POINTS = ("the loader's next batch", "the loader's next pass")
"""The consistent points where a registered loader tells that the loop's next step begins."""

CALLS = ("save()", "wait()", "close()", "consistent_point()", "log()")
"""The consistent points that are calls (the loop's, an integration's): they hold the state as it is when called."""

REASONS: dict[tuple[str, ...], str] = {("log()",): "log()", ("retake",): "save()"}
"""The events' reason of a checkpoint decided by these alone (else ``"policy"``)."""


class PointReached(Protocol):
    """What captures at a consistent point (:class:`~checkfreq.pipeline.save.taker.Taker`)."""

    def at_point(self, where: str) -> None:
        """The step's consistent point came, at ``where``."""


class PointListener:
    """Passes what a loader, a module or an optimizer tells on to ``owner.at_point`` while ``owner``
    lives (no registered object keeps a Checkpointer alive)."""

    def __init__(self, owner: PointReached) -> None:
        self._owner = weakref.ref(owner)

    def reached(self, where: str) -> None:
        owner = self._owner()
        if owner is not None:
            owner.at_point(where)

    def before_new_pass(self) -> None:
        if torch.is_grad_enabled():
            self.reached("the loader's next pass")

    def before_batch(self) -> None:
        if torch.is_grad_enabled():
            self.reached("the loader's next batch")


class ConsistentPoint:
    """Holds what ``step()`` decided until the step's consistent point (see the module docstring).

    Args:
        objects: the registered objects: their loaders and modules are watched.
        listener: told when a watched object reaches a point.
    """

    def __init__(self, objects: Iterable[Any], listener: PointListener) -> None:
        objects = list(objects)
        self._loaders = [o for o in objects if isinstance(o, ResumableLoader)]
        self._rng = next((o for o in objects if isinstance(o, RNGState)), None)
        self._listener = listener
        self._forwards = 0  # training forwards of the registered modules so far
        self._handed_out_at: dict[int, int] = {}  # id(loader) -> self._forwards when it last handed out a batch
        self._removers: list[Callable[[], None]] = []
        for loader in self._loaders:
            watcher = _LoaderWatcher(self, loader, listener)
            self._removers.append(loader.add_listener(watcher))
        hook = torch.compiler.disable(self._before_forward)  # run as it is, never traced into a compiled graph
        for module in (o for o in objects if isinstance(o, torch.nn.Module)):
            handle = module.register_forward_pre_hook(hook, prepend=True)
            self._removers.append(handle.remove)
        self.pending: Pending | None = None
        self._warned_late = False
        self._warned_dropped = False

    def hold(self, step: int, *, checkpoint: bool, tiers: Iterable[SnapshotTaker] = (), reason: str) -> None:
        """Add what was decided at ``step`` to what waits for its point."""
        pending = self.pending
        if pending is None or pending.step != step:
            rng = None if self._rng is None else self._rng.state_dict()
            pending = self.pending = Pending(step, checkpoint=False, rng=rng)
        pending.tiers = (*pending.tiers, *(t for t in tiers if t not in pending.tiers))
        if checkpoint:
            pending.checkpoint = True
            pending.reasons.append(reason)

    def take(self) -> Pending | None:
        """What waits for the point, once."""
        pending, self.pending = self.pending, None
        return pending

    @contextlib.contextmanager
    def reached(self, where: str, registered: Registered, peers: Peers, step: int) -> Iterator[Pending | None]:
        """The point ``where`` came at ``step``: what waits for it (None: nothing), while it is captured.

        At a loader's point, a checkpoint that ``save()``/``wait()`` captured earlier in the step and the
        state moved on from (on any rank: collective then) is taken again. At a training forward, a batch a
        loader handed out since the previous one is the next step's; at a point no loader marks, the
        generators are taken as they were at the decision."""
        pending = self.take()
        if pending is None and where in LOADER_POINTS:  # the loop's next step begins here
            pending = _retake(registered, peers, step, where)
        if pending is None:
            yield None
            return
        if where == "optimizer.step()":
            self._reached_late(pending)
        with contextlib.ExitStack() as stack:
            if where == "a training forward":
                for loader in self.in_flight_loaders():
                    stack.enter_context(loader.hold_back_handed_out())
            marked = where in LOADER_POINTS or where in CALLS
            stack.enter_context(registered.generators_as(None if marked else pending.rng))
            yield pending

    def logged(self, step: int, metrics: Mapping[str, Any], registered: Registered) -> bool:
        """``log()`` of the ranked metric at ``step``: a checkpoint of that step takes the score at its capture
        (one is decided if none was). One that a call captured (``save()``, an integration's point) is taken
        again: True, capture it now. One captured at a point the loop's next step marked cannot (said once)."""
        pending = self.pending
        if pending is not None and pending.step == step and pending.checkpoint:
            return False
        if registered.scores.captured_step == step and (registered.seal is None or registered.seal.at not in CALLS):
            registered.warn_logged_after_capture(step, metrics)
            return False
        self.hold(step, checkpoint=True, reason="log()")
        return registered.scores.captured_step == step

    def drop(self, error: BaseException) -> None:
        """The loop left on ``error`` before the point: what was decided is not taken (said once)."""
        pending = self.take()
        if pending is None or not (pending.checkpoint or pending.tiers) or self._warned_dropped:
            return
        self._warned_dropped = True
        log.warning(
            "the checkpoint decided at step %d was not taken: the loop left on %s before the step's "
            "consistent point, so the step's work may be half done (the newest checkpoint stands)",
            pending.step,
            type(error).__name__,
        )

    def _reached_late(self, pending: Pending) -> None:
        """Warn once that ``pending`` was captured only at the next ``optimizer.step()``, after that step's forward."""
        if self._warned_late or not (pending.checkpoint or pending.tiers):
            return
        self._warned_late = True
        log.warning(
            "the checkpoint decided at step %d was captured at the next optimizer.step(), after that step's forward "
            "and backward: no registered ResumableLoader was asked for a batch and no registered module ran a "
            "training forward in between. Dropout's random numbers and BatchNorm's buffers of that forward are in "
            "it. Register the module the loop calls (model=...) or the loader it takes batches from "
            '(docs/exactness.md, "The consistent point").',
            pending.step,
        )

    def in_flight_loaders(self) -> list[ResumableLoader]:
        """The loaders that handed out a batch since the last training forward: at a point reached by a
        training forward, that batch is this forward's, of the next step (a prefetching loop)."""
        return [loader for loader in self._loaders if self._handed_out_at.get(id(loader)) == self._forwards]

    def close(self) -> None:
        """Stop watching."""
        for remove in self._removers:
            remove()
        self._removers = []
        self.pending = None

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return None  # an evaluation: not the next step
        if self.pending is not None:
            self._listener.reached("a training forward")
        self._forwards += 1
        return None

    def _handing_out(self, loader: ResumableLoader) -> None:
        self._handed_out_at[id(loader)] = self._forwards


def _retake(registered: Registered, peers: Peers, step: int, where: str) -> Pending | None:
    """A checkpoint of ``step`` that ``save()``/``wait()`` captured before ``where``, and registered state changed
    since (on any rank): to be taken again, as ``save()`` takes a step again."""
    changed = registered.changed_since_early_capture(step, peers)
    if changed is None:
        return None
    log.info(
        "%s changed after the checkpoint of step %d was captured and before %s: taking step %d again",
        ", ".join(changed) or "another rank's state",
        step,
        where,
        step,
    )
    return Pending(step, checkpoint=True, reasons=["retake"])


class _LoaderWatcher:
    """One loader's listener: a point when it moves, and when it handed out its batch."""

    def __init__(self, point: ConsistentPoint, loader: ResumableLoader, listener: PointListener) -> None:
        self._point, self._loader, self._listener = point, loader, listener

    def before_new_pass(self) -> None:
        self._listener.before_new_pass()

    def before_batch(self) -> None:
        self._listener.before_batch()
        self._point._handing_out(self._loader)


__all__ = ["ConsistentPoint", "Pending", "PointListener", "PointReached"]
