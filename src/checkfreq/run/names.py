"""A warning for a registration keyword that misspells a common name (``sheduler=`` for ``scheduler=``).

Any object with ``state_dict()`` is registered under whatever keyword it is given, by design, so a
misspelled name is not an error: the object is checkpointed under it. But a later run that
registers it under the right name would not find it in those checkpoints, so a keyword one edit
away from ``model``, ``optimizer``, ``scheduler``, ``loader`` or ``scaler`` whose object is of
that kind is logged as a warning, once per registration. A common name numbered (``optimizer0``, as
the Lightning callback registers them) or in the plural is taken as meant. When such a later run
does not fit, the error names the misspelled name the checkpoints hold (:func:`held_instead`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from checkfreq.data.loader import ResumableLoader

log = logging.getLogger("checkfreq.checkpointer")

COMMON_KINDS: dict[str, tuple[type, ...]] = {
    "model": (torch.nn.Module,),
    "optimizer": (torch.optim.Optimizer,),
    "scheduler": (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau),
    "loader": (torch.utils.data.DataLoader, ResumableLoader),
    "scaler": (torch.amp.GradScaler,),
}
"""The common registration names, each with the kinds of object registered under it."""


def one_edit_apart(a: str, b: str) -> bool:
    """Whether ``a`` becomes ``b`` by one insertion, deletion, substitution or swap of neighbours."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
        return len(diff) == 1 or (
            len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]]
        )
    short, long = (a, b) if len(a) < len(b) else (b, a)
    i = next((i for i, (x, y) in enumerate(zip(short, long, strict=False)) if x != y), len(short))
    return short[i:] == long[i + 1 :]


def misspelled(name: str, obj: Any) -> str | None:
    """The common name ``name`` is one edit (or its case) away from, when ``obj`` is of its kind; else None."""
    if (
        name in COMMON_KINDS
        or name.rstrip("0123456789_") in COMMON_KINDS
        or name[:-1] in COMMON_KINDS
        and name.endswith("s")
    ):
        return None  # numbered (optimizer0, as the Lightning callback registers) or plural: meant so
    near = name.lower()  # a name that differs in case alone is as easily mistaken
    return next(
        (
            common
            for common, kinds in COMMON_KINDS.items()
            if (near == common or one_edit_apart(near, common)) and isinstance(obj, kinds)
        ),
        None,
    )


def warn_misspelled(caller: str, objects: Mapping[str, Any]) -> list[str]:
    """Log a warning for each keyword of ``objects`` that misspells a common name; return the warnings."""
    warnings = []
    for name, obj in objects.items():
        meant = misspelled(name, obj)
        if meant is not None and meant not in objects:
            warnings.append(
                f"{caller}() registered a {type(obj).__qualname__} as {name!r}: did you mean {meant}=? It is "
                f"checkpointed under {name!r}, so a run that registers it as {meant!r} will not find it in "
                "these checkpoints (a name of your own is fine: this is only a warning)"
            )
            log.warning("%s", warnings[-1])
    return warnings


def held_instead(missing: str, held: Iterable[str]) -> str | None:
    """The name among ``held`` (what a checkpoint holds that nothing registered takes) one edit, or its
    case, away from ``missing``: where a run that misspelled ``missing`` checkpointed its object."""
    return next((name for name in held if name.lower() == missing or one_edit_apart(name.lower(), missing)), None)
