"""What :class:`~checkfreq.errors.NoValidCheckpointError` tells a user: what the restore tried, in
which tiers, why each checkpoint failed, and the ways out."""

from __future__ import annotations

from collections.abc import Sequence

from checkfreq.errors import NoValidCheckpointError
from checkfreq.pipeline.tiers.chosen import Tiers


def no_valid_checkpoint(tiers: Tiers, step: int | None, skipped: Sequence[tuple[str, str]]) -> NoValidCheckpointError:
    """The error for a restore that found checkpoints (or the one at ``step``) but could read none.

    ``skipped`` lists ``(checkpoint or memory slot, why)`` for each one tried, newest first.
    """
    searched = tiers.searched()
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
