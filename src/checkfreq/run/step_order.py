"""Catches ``Checkpointer.step()`` called before ``optimizer.step()``.

Called before, every checkpoint labelled step N holds the weights after N - 1 updates, and a
resume silently loses one update. The signature is a session's first ``step()`` (after the
Checkpointer is built, after :meth:`~checkfreq.Checkpointer.restore` or
:meth:`~checkfreq.Checkpointer.start_at`) with no registered optimizer stepped since the session
began. A GradScaler that skipped the optimizer step (an overflow at the first step of a float16
run) is told apart by its scale, which it lowers on every skip.
"""

from __future__ import annotations

from typing import Any

import torch

from checkfreq.errors import UsageError


class StepOrder:
    """Watches the registered optimizers (and GradScalers) for the first ``step()`` of each session.

    Args:
        optimizers: the torch optimizers whose ``step()`` runs (wrappers already unwrapped).
        objects: every registered object: a GradScaler, or an object holding one as ``scaler``
            (Lightning's precision plugin), may skip an optimizer step legitimately.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer], objects: list[Any]) -> None:
        self._scalers = [s for s in (_scaler_of(o) for o in objects) if s is not None]
        self._scales: list[float] = []
        self._handles = [opt.register_step_post_hook(self._note_step) for opt in optimizers]
        self._stepped = False
        self._checked = False
        self.begin_session()

    def begin_session(self) -> None:
        """A session begins (construction, restore, start_at): its first ``step()`` is checked."""
        self._stepped = False
        self._checked = not self._handles  # nothing to watch without an optimizer
        self._scales = [s.get_scale() for s in self._scalers]

    def check(self, step: int) -> None:
        """Raise :class:`UsageError` if ``step()`` (counting ``step``) comes before any optimizer step
        of the session."""
        if self._checked:
            return
        self._checked = True
        if self._stepped or any(s.get_scale() < before for s, before in zip(self._scalers, self._scales, strict=True)):
            return  # an optimizer stepped, or a GradScaler skipped its step on an overflow
        raise UsageError(
            f"Checkpointer.step() was called for step {step} before any registered optimizer stepped in this "
            "session: call it once per optimizer step, right after optimizer.step() (and scheduler.step()). "
            "Called before, each checkpoint labelled step N holds the state after N - 1 updates and a resume "
            "loses one update. With gradient accumulation, call it only after the micro-batch whose "
            "optimizer.step() updates the weights."
        )

    def close(self) -> None:
        """Remove the hooks; nothing is checked any more."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._checked = True

    def _note_step(self, *_: Any) -> None:
        self._stepped = True


def _scaler_of(obj: Any) -> torch.amp.GradScaler | None:
    """The enabled GradScaler ``obj`` is or holds as ``scaler``, if any."""
    for candidate in (obj, getattr(obj, "scaler", None)):
        if isinstance(candidate, torch.amp.GradScaler) and candidate.is_enabled():
            return candidate
    return None


def stepped_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer whose ``step()`` runs: a wrapper's (Accelerate's ``AcceleratedOptimizer``) inner one."""
    inner = getattr(optimizer, "optimizer", None)
    while isinstance(inner, torch.optim.Optimizer):
        optimizer, inner = inner, getattr(inner, "optimizer", None)
    return optimizer
