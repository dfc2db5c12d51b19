"""What :class:`~checkfreq.errors.NoValidCheckpointError` tells a user: what the restore tried, in
which tiers, why each checkpoint failed, and the ways out."""

from __future__ import annotations

from collections.abc import Sequence

from checkfreq.errors import NoValidCheckpointError
from checkfreq.pipeline.tiers.chosen import Tiers
from checkfreq.storage.base import Aside
from checkfreq.storage.format import checkpoint_name


def no_valid_checkpoint(
    tiers: Tiers, step: int | None, skipped: Sequence[tuple[str, str]], listed: Sequence[int] = ()
) -> NoValidCheckpointError:
    """The error for a restore that found checkpoints (or the one at ``step``) but could read none.

    ``skipped`` lists ``(checkpoint or memory slot, why)`` for each one tried, newest first; ``listed``
    the steps the tiers list (newest first), named when ``step`` is none of them.
    """
    searched = tiers.searched()
    if step is not None and not skipped:
        return _never_kept(tiers, step, listed)
    what = f"for step {step}" if step is not None else "to restore"
    tried = ", ".join(name for name, _ in skipped) or "none"
    reasons = "; ".join(f"{name}: {why}" for name, why in skipped)
    root = tiers.store.root
    ways = [f"`checkfreq verify {root}` tells what is wrong with each checkpoint and sets the damaged ones aside"]
    if step is not None:
        ways.append("restore() without step= tries every listed step, newest first")
    else:
        ways.append(
            f"restore(step=N) picks one step, once a good copy of it is back in {root} "
            f"(`checkfreq ls {root}` lists the steps)"
        )
    if tiers.far:
        ways.append("the remote tier was read for each damaged file: check that it is reachable and whole")
    else:
        ways.append("a copy kept elsewhere is read by giving its place as the remote tier (remote=...)")
    ways.append("or start fresh with a new directory (the damaged checkpoints stay where they are)")
    return NoValidCheckpointError(
        f"no valid checkpoint {what} in {tiers.where()}: tried {tried} in the {' and '.join(searched)}"
        + (f" ({reasons})" if reasons else "")
        + ". Ways out: "
        + "; ".join(ways)
    )


def _never_kept(tiers: Tiers, step: int, listed: Sequence[int]) -> NoValidCheckpointError:
    """``restore(step=step)`` for a step no tier holds: nothing is damaged, the step was never kept
    (or retention removed it); the steps there are the ones to pick from."""
    root = tiers.store.root
    aside = [a for a in tiers.store.set_aside_checkpoints() if a.step == step]
    left = [a for a in aside if a.kind is Aside.ABANDONED]
    if left:
        return NoValidCheckpointError(
            f"the checkpoint of step {step} in {root} is of a course the run left ({left[0].reason}) and was "
            f"set aside as {left[0].name}: it is never restored; to go back to that course, rename it to "
            f'{checkpoint_name(step)} by hand (docs/storage.md, "Going on from an older checkpoint"), or restore '
            f"another step (`checkfreq ls {root}` lists them)"
        )
    if aside:
        return NoValidCheckpointError(
            f"the checkpoint of step {step} in {root} was set aside as damaged ({', '.join(a.name for a in aside)}): "
            "it is never "
            'restored; put it back by hand if its damage has passed (docs/storage.md, "Damaged checkpoints"), or '
            f"restore another step (`checkfreq ls {root}` lists them and which are valid)"
        )
    if listed:
        shown = ", ".join(str(s) for s in listed[:20]) + (f" and {len(listed) - 20} older" if len(listed) > 20 else "")
        there = f"the steps there are {shown}: restore(step=N) takes one of them, restore() the newest valid one"
    else:
        there = "no checkpoint is there at all: restore() without step= starts fresh"
    return NoValidCheckpointError(
        f"no checkpoint of step {step} in the {' or '.join(tiers.searched())}: none was kept at "
        f"that step, or retention has removed it; {there} (`checkfreq ls {root}` lists them and which are valid)"
    )
