"""The training loss for convergence-aware policies, read without waiting for the device."""

from __future__ import annotations

import math
from typing import Any

import torch


class LossFeed:
    """Hands the policy the newest loss that has already reached the host.

    Reading a CUDA loss with ``.item()`` waits for every kernel queued before it, at every step.
    :meth:`push` instead starts a non-blocking copy into pinned host memory (at most one in
    flight) and :meth:`take` returns the loss once its copy has completed, so the value the
    policy sees may be a step or two old, and no step waits for the device. A CPU loss is read
    at once. Each loss is handed out once: a step whose loss has not arrived feeds none.
    """

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self._copied: Any = None  # the CUDA event of the copy in flight
        self._latest: float | None = None

    def push(self, loss: Any) -> None:
        """Offer this step's loss (a tensor, a number or None)."""
        if loss is None:
            return
        if not isinstance(loss, torch.Tensor):
            self._latest = float(loss)
            return
        loss = loss.detach()
        if loss.numel() != 1:
            return  # not a scalar loss: nothing to feed
        if loss.device.type != "cuda":
            self._latest = float(loss)
            return
        self._harvest()
        if self._copied is not None:
            return  # the previous copy is still in flight
        if self._host is None:
            self._host = torch.empty((), dtype=torch.float32, pin_memory=True)
        self._host.copy_(loss.reshape(()).float(), non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def take(self) -> float | None:
        """The newest loss that arrived on the host since the last call (None if none, or not finite)."""
        self._harvest()
        latest, self._latest = self._latest, None
        return latest if latest is not None and math.isfinite(latest) else None

    def _harvest(self) -> None:
        """Take the loss of a finished copy (checking the event does not wait for the device)."""
        if self._copied is not None and self._copied.query():
            self._latest, self._copied = float(self._host), None  # type: ignore[arg-type]
