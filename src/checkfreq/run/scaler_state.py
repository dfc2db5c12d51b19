"""A GradScaler's state without a device sync, and back.

``GradScaler.state_dict()`` reads its scale and growth tracker with ``.item()``: on a GPU each
snapshot of a mixed-precision run would wait on the training thread for every kernel queued so
far. :func:`capture` takes the two device tensors themselves instead (0-dim, updated in place by
``scaler.update()``), and the plain floats and ints as they are: the fingerprints of the small
state see a change of the tensors by their version counters, and a checkpoint copies them
(:func:`freeze`) in stream order, asynchronously, like any other tensor of the state.
:func:`loadable` turns such a state back into the plain numbers ``GradScaler.load_state_dict``
documents (restore and ``checkfreq export`` are off the training loop); a state saved as numbers
(a checkpoint written before) passes unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

SCALE, TRACKER = "scale", "_growth_tracker"
KEYS = frozenset({SCALE, "growth_factor", "backoff_factor", "growth_interval", TRACKER})
"""The entries of a GradScaler's state."""


def is_grad_scaler(obj: object) -> bool:
    """Whether ``obj`` is a GradScaler whose state :func:`capture` takes (its ``state_dict`` is torch's own)."""
    return isinstance(obj, torch.amp.GradScaler) and type(obj).state_dict is torch.amp.GradScaler.state_dict


def capture(scaler: torch.amp.GradScaler) -> dict[str, Any]:
    """``scaler.state_dict()`` with the scale and growth tracker as the scaler's own tensors (no ``.item()``)."""
    if not scaler.is_enabled():
        return {}
    scale, tracker = scaler._scale, scaler._growth_tracker  # None until the scaler's first use: the initial numbers
    return {
        SCALE: scaler._init_scale if scale is None else scale.detach(),
        "growth_factor": scaler._growth_factor,
        "backoff_factor": scaler._backoff_factor,
        "growth_interval": scaler._growth_interval,
        TRACKER: scaler._init_growth_tracker if tracker is None else tracker.detach(),
    }


def freeze(tensors: dict[str, torch.Tensor], scalers: Iterable[str]) -> set[str]:
    """Replace the scale and growth tracker of each GradScaler registered under a name of ``scalers``
    among the flattened ``tensors`` by a copy made now in stream order (an asynchronous kernel, no
    sync); return their names. Nothing changes the copies, so the snapshot may read them as late as
    the optimizer state, behind the fence: the live tensors change in ``scaler.update()``, which
    also runs when an overflow made the scaler skip the optimizer step (and the fence)."""
    frozen = {f"{name}/{key}" for name in scalers for key in (SCALE, TRACKER)} & tensors.keys()
    with torch.no_grad():
        for name in frozen:
            tensors[name] = tensors[name].clone()
    return frozen


def loadable(state: Any) -> Any:
    """A GradScaler's saved ``state`` with its scale as a float and its growth tracker as an int, as
    ``load_state_dict`` expects; anything that is not a GradScaler's state is returned as it is."""
    if not is_scaler_state(state):
        return state
    out = dict(state)
    if isinstance(out[SCALE], torch.Tensor):
        out[SCALE] = float(out[SCALE].detach().cpu().reshape(-1)[0])
    if isinstance(out[TRACKER], torch.Tensor):
        out[TRACKER] = int(out[TRACKER].detach().cpu().reshape(-1)[0])
    return out


def is_scaler_state(state: Any) -> bool:
    """Whether ``state`` has exactly a GradScaler's entries, its scale and tracker numbers or one-element tensors."""
    return isinstance(state, Mapping) and set(state) == KEYS and all(_one_number(state[k]) for k in (SCALE, TRACKER))


def _one_number(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, (int, float)) and not isinstance(value, bool)


__all__ = ["KEYS", "capture", "freeze", "is_grad_scaler", "is_scaler_state", "loadable"]
