"""Keyword arguments that are options, told apart from the objects registered for checkpointing.

Entry points such as :class:`~checkfreq.Checkpointer` take options and the objects to checkpoint
as keywords. Only objects with ``state_dict()``/``load_state_dict()`` may be registered that way;
anything else is a misspelled option or a plain value, and is refused with a ``TypeError`` that
names the closest option, so that a typo never becomes checkpointed state.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

import torch.utils.data

from checkfreq.errors import ArgumentTypeError, InvalidArgumentError
from checkfreq.policies.retention import Retention
from checkfreq.run.names import warn_misspelled
from checkfreq.run.state import Stateful

PLAIN_VALUES_HINT = "register plain values with values={...} or ckpt['name'] = value"
LOADER_HINT = (
    "use checkfreq.data.ResumableLoader(dataset, batch_size, shuffle=..., seed=...), "
    "which takes DataLoader's arguments, or torchdata's StatefulDataLoader"
)


def closest(name: str, valid: Iterable[str]) -> str | None:
    """The valid name ``name`` most probably misspells, if any is close enough."""
    matches = difflib.get_close_matches(name, sorted(valid), n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_option(caller: str, name: str, valid: Iterable[str], hint: str = "") -> ArgumentTypeError:
    """The error for an unexpected keyword ``name`` of ``caller``, with a did-you-mean if one is close."""
    message = f"{caller}() got an unexpected keyword argument {name!r}"
    guess = closest(name, valid)
    if guess is not None:
        message += f"; did you mean {guess!r}?"
    if hint:
        message += f" ({hint})"
    return ArgumentTypeError(message)


def check_objects(
    caller: str, objects: Mapping[str, Any], options: Iterable[str], option_types: tuple[type, ...] = ()
) -> None:
    """Refuse every keyword in ``objects`` that is not a stateful object to register, and warn of one
    that misspells a common name (:mod:`checkfreq.run.names`).

    A value of one of ``option_types`` (a policy) is a misspelled option even when it
    has a ``state_dict()``; any other value without one is a misspelled option or a plain value.
    """
    options = list(options)
    for name, obj in objects.items():
        if isinstance(obj, option_types) or not isinstance(obj, Stateful):
            if isinstance(obj, torch.utils.data.DataLoader):
                raise ArgumentTypeError(
                    f"{caller}() cannot checkpoint {name}={type(obj).__qualname__}(...): a plain DataLoader has no "
                    f"state_dict()/load_state_dict() and cannot resume where it stopped; {LOADER_HINT}"
                )
            hint = (
                ""
                if closest(name, options) is not None
                else (
                    f"its value, a {type(obj).__qualname__}, has no state_dict()/load_state_dict(); {PLAIN_VALUES_HINT}"
                )
            )
            raise unknown_option(caller, name, options, hint)
    warn_misspelled(caller, objects)


def check_names(caller: str, names: Iterable[str], options: Iterable[str]) -> None:
    """Refuse any of ``names`` that is not one of ``options`` (for entry points that forward options)."""
    options = list(options)
    for name in names:
        if name not in options:
            raise unknown_option(caller, name, options)


def check_option_types(
    *, keep: Any, remote_keep: Any, rng: Any, allow_pickle: Any, persist_timeout: Any, failure_timeout: Any = 30.0
) -> None:
    """Refuse option values of the wrong type, such as an object registered under an option's name."""
    counts = {"keep": keep} if remote_keep is None else {"keep": keep, "remote_keep": remote_keep}
    for name, value in counts.items():
        if isinstance(value, Retention):
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ArgumentTypeError(
                f"{name} must be an int (checkpoints to keep) or a checkfreq.Retention, got {type(value).__qualname__}"
            )
        if value < 1:
            raise InvalidArgumentError(f"{name} must be at least 1, got {value}")
    for name, value in {"rng": rng, "allow_pickle": allow_pickle}.items():
        if not isinstance(value, bool):
            raise ArgumentTypeError(f"{name} must be True or False, got {type(value).__qualname__}")
    if isinstance(persist_timeout, bool) or not isinstance(persist_timeout, (int, float)) or persist_timeout <= 0:
        raise ArgumentTypeError(f"persist_timeout must be a positive number of seconds, got {persist_timeout!r}")
    if (
        isinstance(failure_timeout, bool)
        or not isinstance(failure_timeout, (int, float))
        or not 0 < failure_timeout < 1e6
    ):
        raise ArgumentTypeError(
            f"failure_timeout must be a positive number of seconds (under a million), got {failure_timeout!r}"
        )


def check_registration(objects: Mapping[str, Any], values: Mapping[str, Any], reserved: Iterable[str]) -> None:
    """Refuse a registration that could not be checkpointed as the user means it (``ValueError``)."""
    if not objects and not values:
        raise InvalidArgumentError("register at least one object to checkpoint, e.g. Checkpointer(dir, model=model)")
    for name in [*objects, *values]:
        if name in reserved:
            raise InvalidArgumentError(f"{name!r} is reserved by checkfreq; register it under another name")
    for name, obj in objects.items():
        if getattr(obj, "use_stateful_dataloader", None) is False:  # has state_dict(), but no position to give
            raise InvalidArgumentError(
                f"{name!r} is a {type(obj).__name__} prepared by Accelerate, which cannot save its position; "
                "register a checkfreq.data.ResumableLoader (not passed to accelerator.prepare) instead"
            )
    both = sorted(set(objects) & set(values))
    if both:
        raise InvalidArgumentError(f"{', '.join(map(repr, both))} registered both as an object and in values=")
